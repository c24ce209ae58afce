"""SpeechTokenizer-style 16 kHz codec: RVQ level 1 is distilled towards HuBERT layer-9
features so the first codebook carries content and the rest carry acoustics.

    torchrun --nproc_per_node=8 20_speechtokenizer_semantic_distill.py --train lists/ls960_train.txt \
        --out /nfs/exp/st_v1 [--resume /nfs/exp/st_v1/ckpt_0100000.pt]
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
from transformers import HubertModel

SR, HOP = 16000, 320


class SpeechClips(Dataset):
    def __init__(self, list_file, seconds=3.0):
        self.files = [l.split("\t")[0] for l in open(list_file).read().splitlines() if l]
        self.n = int(seconds * SR) // HOP * HOP

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        wav = wav[0]
        if wav.numel() >= self.n:
            s = random.randint(0, wav.numel() - self.n)
            wav = wav[s : s + self.n]
        return F.pad(wav, (0, self.n - wav.numel()))[None]


def res_unit(ch, d):
    return nn.Sequential(nn.ELU(), weight_norm(nn.Conv1d(ch, ch, 3, dilation=d, padding=d)),
                         nn.ELU(), weight_norm(nn.Conv1d(ch, ch, 1)))


class ResStack(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.units = nn.ModuleList(res_unit(ch, d) for d in (1, 3, 9))

    def forward(self, x):
        for u in self.units:
            x = x + u(x)
        return x


class SpeechTokenizer(nn.Module):
    def __init__(self, ch=32, dim=1024, n_q=8, bins=1024, strides=(2, 4, 5, 8), hubert_dim=768):
        super().__init__()
        enc, c = [weight_norm(nn.Conv1d(1, ch, 7, padding=3))], ch
        for s in strides:
            enc += [ResStack(c), nn.ELU(), weight_norm(nn.Conv1d(c, 2 * c, 2 * s, s, padding=(s + 1) // 2))]
            c *= 2
        enc += [nn.ELU(), weight_norm(nn.Conv1d(c, dim, 3, padding=1))]
        self.encoder = nn.Sequential(*enc)
        self.codebooks = nn.ModuleList(nn.Embedding(bins, dim) for _ in range(n_q))
        self.semantic_proj = nn.Linear(dim, hubert_dim)
        dec = [weight_norm(nn.Conv1d(dim, c, 7, padding=3))]
        for s in reversed(strides):
            dec += [nn.ELU(), weight_norm(nn.ConvTranspose1d(c, c // 2, 2 * s, s, padding=(s + 1) // 2, output_padding=s % 2)), ResStack(c // 2)]
            c //= 2
        dec += [nn.ELU(), weight_norm(nn.Conv1d(c, 1, 7, padding=3)), nn.Tanh()]
        self.decoder = nn.Sequential(*dec)

    def forward(self, x):
        z = self.encoder(x).transpose(1, 2)
        res, zq, vq_loss, first = z, torch.zeros_like(z), 0.0, None
        for cb in self.codebooks:
            idx = torch.cdist(res, cb.weight[None].expand(res.shape[0], -1, -1)).argmin(-1)
            q = cb(idx)
            vq_loss = vq_loss + F.mse_loss(q, res.detach()) + 0.25 * F.mse_loss(res, q.detach())
            q = res + (q - res).detach()
            first = q if first is None else first
            zq, res = zq + q, res - q.detach()
        y = self.decoder(zq.transpose(1, 2))[..., : x.shape[-1]]
        return y, vq_loss / len(self.codebooks), self.semantic_proj(first)


class STFTDisc(nn.Module):
    def __init__(self, n_fft):
        super().__init__()
        self.n_fft = n_fft
        self.net = nn.ModuleList([
            weight_norm(nn.Conv2d(2, 32, (3, 9), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 32, (3, 9), (1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 32, (3, 9), (1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 1, (3, 3), padding=(1, 1))),
        ])

    def forward(self, x):
        spec = torch.stft(x[:, 0], self.n_fft, self.n_fft // 4, window=torch.hann_window(self.n_fft, device=x.device),
                          return_complex=True)
        h, fmaps = torch.stack([spec.real, spec.imag], 1), []
        for i, conv in enumerate(self.net):
            h = conv(h)
            if i < len(self.net) - 1:
                h = F.leaky_relu(h, 0.2)
                fmaps.append(h)
        return h, fmaps


class MultiSTFTDisc(nn.Module):
    def __init__(self):
        super().__init__()
        self.discs = nn.ModuleList(STFTDisc(n) for n in (256, 512, 1024))

    def forward(self, x):
        return [d(x) for d in self.discs]


def mel_loss(x, y, mel):
    return F.l1_loss(mel(x).clamp(min=1e-5).log(), mel(y).clamp(min=1e-5).log())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--batch-size", type=int, default=20, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--distill-weight", type=float, default=120.0)
    ap.add_argument("--save-every", type=int, default=20_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    ds = SpeechClips(args.train)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    hubert = HubertModel.from_pretrained("facebook/hubert-base-ls960").to(device).eval().requires_grad_(False)
    model, disc = SpeechTokenizer(), MultiSTFTDisc()
    step, ck = 0, None
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        disc.load_state_dict(ck["disc"])
        step = ck["step"]
    model = DDP(model.to(device), device_ids=[local_rank])
    disc = DDP(disc.to(device), device_ids=[local_rank])
    opt_g = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=args.lr, betas=(0.5, 0.9))
    if ck is not None:
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        del ck
    mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=256, n_mels=80).to(device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    epoch, t0 = step // len(dl), time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(device, non_blocking=True)
            with torch.no_grad():
                target = hubert(x[:, 0], output_hidden_states=True).hidden_states[9]  # [B, T', 768]
            y, vq_loss, sem = model(x)
            target = F.interpolate(target.transpose(1, 2), size=sem.shape[1], mode="nearest").transpose(1, 2)

            d_out = disc(torch.cat([x, y.detach()]))
            loss_d = sum(F.relu(1 - o.chunk(2)[0]).mean() + F.relu(1 + o.chunk(2)[1]).mean() for o, _ in d_out) / 3
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

            g_out = disc(torch.cat([x, y]))
            loss_adv = sum(F.relu(1 - o.chunk(2)[1]).mean() for o, _ in g_out) / 3
            loss_fm = sum(F.l1_loss(f.chunk(2)[1], f.chunk(2)[0].detach()) for _, fm in g_out for f in fm) / 9
            loss_mel = mel_loss(y, x, mel)
            loss_distill = -F.logsigmoid(F.cosine_similarity(sem, target, dim=-1)).mean()
            loss_g = loss_adv + 3.0 * loss_fm + 45.0 * loss_mel + vq_loss + args.distill_weight * loss_distill
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            step += 1

            if step % 100 == 0:
                rep = torch.stack([loss_d, loss_adv, loss_fm, loss_mel, loss_distill]).detach()
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    names = ("d", "adv", "fm", "mel", "distill")
                    print(f"step {step} " + " ".join(f"{n}={v:.4f}" for n, v in zip(names, rep.tolist())) +
                          f" {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "disc": disc.state_dict(),
                                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "step": step},
                               os.path.join(args.out, f"ckpt_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
