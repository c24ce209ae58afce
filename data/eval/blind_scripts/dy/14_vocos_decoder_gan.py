"""Vocos-style replacement decoder for EnCodec 24 kHz tokens.

A ConvNeXt backbone predicts STFT magnitude/phase from the frozen EnCodec quantised
latents and an ISTFT head renders the waveform. Trained against multi-period and
multi-resolution discriminators.

    torchrun --nproc_per_node=8 14_vocos_decoder_gan.py --train lists/train.txt --out /shared/vocos_enc24
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import EncodecModel

SR, HOP = 24000, 320


class Clips(Dataset):
    def __init__(self, list_file, n):
        self.files = open(list_file).read().split()
        self.n = n

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        wav = torchaudio.functional.resample(wav.mean(0, keepdim=True), sr, SR)
        if wav.shape[-1] > self.n:
            s = random.randint(0, wav.shape[-1] - self.n)
            wav = wav[:, s : s + self.n]
        wav = F.pad(wav, (0, self.n - wav.shape[-1]))
        return wav * (10 ** (random.uniform(-1, -6) / 20)) / wav.abs().max().clamp(min=1e-3)


class ConvNeXt(nn.Module):
    def __init__(self, dim, mult=3):
        super().__init__()
        self.dw = nn.Conv1d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, dim * mult), nn.Linear(dim * mult, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x):
        h = self.dw(x).transpose(1, 2)
        h = self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class VocosDecoder(nn.Module):
    def __init__(self, in_dim=128, dim=512, layers=8, n_fft=1280):
        super().__init__()
        self.n_fft = n_fft
        self.embed = nn.Conv1d(in_dim, dim, 7, padding=3)
        self.blocks = nn.Sequential(*[ConvNeXt(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_fft + 2)
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, z):
        h = self.blocks(self.embed(z)).transpose(1, 2)
        mag, phase = self.head(self.norm(h)).transpose(1, 2).chunk(2, 1)
        spec = torch.exp(mag).clamp(max=1e2) * torch.exp(1j * phase)
        return torchaudio.functional.inverse_spectrogram(
            spec, length=z.shape[-1] * HOP, pad=0, window=self.window, n_fft=self.n_fft,
            hop_length=HOP, win_length=self.n_fft, normalized=False, center=True)[:, None]


class PeriodD(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p
        ch = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList(weight_norm(nn.Conv2d(ch[i], ch[i + 1], (5, 1), (3, 1), padding=(2, 0))) for i in range(4))
        self.post = weight_norm(nn.Conv2d(1024, 1, (3, 1), padding=(1, 0)))

    def forward(self, x):
        b, _, t = x.shape
        x = F.pad(x, (0, (-t) % self.p), "reflect").view(b, 1, -1, self.p)
        fm = []
        for c in self.convs:
            x = F.leaky_relu(c(x), 0.1)
            fm.append(x)
        return self.post(x), fm


class ResD(nn.Module):
    def __init__(self, n_fft):
        super().__init__()
        self.n_fft = n_fft
        self.convs = nn.ModuleList(weight_norm(nn.Conv2d(ci, 32, (3, 9), (1, s), padding=(1, 4)))
                                   for ci, s in ((1, 1), (32, 2), (32, 2), (32, 1)))
        self.post = weight_norm(nn.Conv2d(32, 1, 3, padding=1))

    def forward(self, x):
        s = torch.stft(x[:, 0], self.n_fft, self.n_fft // 4, window=torch.hann_window(self.n_fft, device=x.device),
                       return_complex=True).abs()[:, None]
        fm = []
        for c in self.convs:
            s = F.leaky_relu(c(s), 0.1)
            fm.append(s)
        return self.post(s), fm


class Discriminators(nn.Module):
    def __init__(self):
        super().__init__()
        self.ds = nn.ModuleList([PeriodD(p) for p in (2, 3, 5, 7, 11)] + [ResD(n) for n in (512, 1024, 2048)])

    def forward(self, x):
        return [d(x) for d in self.ds]


def mel_l1(x, y, mel):
    return F.l1_loss(mel(x).clamp(min=1e-5).log(), mel(y).clamp(min=1e-5).log())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bandwidth", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=128, help="global")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--mel-weight", type=float, default=45.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    n = int(args.seconds * SR) // HOP * HOP
    ds = Clips(args.train, n)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size // world, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    encodec = EncodecModel.from_pretrained("facebook/encodec_24khz").to(device).eval().requires_grad_(False)
    gen = DDP(VocosDecoder().to(device), device_ids=[local_rank])
    disc = DDP(Discriminators().to(device), device_ids=[local_rank])
    opt_g = torch.optim.AdamW(gen.parameters(), args.lr, betas=(0.8, 0.9))
    opt_d = torch.optim.AdamW(disc.parameters(), args.lr, betas=(0.8, 0.9))
    sch_g = torch.optim.lr_scheduler.CosineAnnealingLR(opt_g, args.steps)
    sch_d = torch.optim.lr_scheduler.CosineAnnealingLR(opt_d, args.steps)
    mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=256, n_mels=100).to(device)

    ckpt = os.path.join(args.out, "last.pt")
    step = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        gen.module.load_state_dict(st["gen"])
        disc.module.load_state_dict(st["disc"])
        opt_g.load_state_dict(st["opt_g"])
        opt_d.load_state_dict(st["opt_d"])
        sch_g.load_state_dict(st["sch_g"])
        sch_d.load_state_dict(st["sch_d"])
        step = st["step"]

    epoch, t0 = step // len(dl), time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for wav in dl:
            wav = wav.to(device, non_blocking=True)
            with torch.no_grad():
                codes = encodec.encode(wav, bandwidth=args.bandwidth).audio_codes[0]
                z = encodec.quantizer.decode(codes.transpose(0, 1))
            fake = gen(z)

            d_out = disc(torch.cat([wav, fake.detach()]))
            loss_d = sum(F.relu(1 - o.chunk(2)[0]).mean() + F.relu(1 + o.chunk(2)[1]).mean() for o, _ in d_out)
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

            g_out = disc(torch.cat([wav, fake]))
            loss_adv = sum(F.relu(1 - o.chunk(2)[1]).mean() for o, _ in g_out) / len(g_out)
            loss_fm = sum(F.l1_loss(f.chunk(2)[1], f.chunk(2)[0].detach()) for _, fms in g_out for f in fms) / len(g_out)
            loss_mel = mel_l1(fake, wav, mel)
            loss_g = loss_adv + 2.0 * loss_fm + args.mel_weight * loss_mel
            if not torch.isfinite(loss_g):
                print(f"[rank {rank}] non-finite generator loss at step {step}, skipping batch", flush=True)
                opt_g.zero_grad(set_to_none=True)
                continue
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            torch.nn.utils.clip_grad_norm_(gen.parameters(), 100.0)
            opt_g.step()
            sch_g.step()
            sch_d.step()
            step += 1

            if step % 100 == 0:
                rep = torch.stack([loss_d.detach(), loss_adv.detach(), loss_fm.detach(), loss_mel.detach()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    d, a, f, m = rep.tolist()
                    print(f"step {step} d {d:.3f} adv {a:.3f} fm {f:.3f} mel {m:.4f} "
                          f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

            if step % 10_000 == 0:
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"gen": gen.module.state_dict(), "disc": disc.module.state_dict(),
                                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                                "sch_g": sch_g.state_dict(), "sch_d": sch_d.state_dict(), "step": step}, ckpt + ".tmp")
                    os.replace(ckpt + ".tmp", ckpt)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
