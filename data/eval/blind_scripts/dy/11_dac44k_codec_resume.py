"""44.1 kHz DAC-style codec: Snake activations, factorised (low-dim) RVQ codebooks with
L2-normalised lookup, multi-resolution spectrogram discriminator.

Jobs are preempted regularly, so training always restarts from `<run>/latest.pth` if present.

    torchrun --nproc_per_node=8 11_dac44k_codec_resume.py --run /nfs/runs/dac44k_v2 --data /nfs/audio/44k
"""
import argparse
import glob
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

SR = 44100
HOP = 512  # 2 * 4 * 8 * 8


class Crops(Dataset):
    def __init__(self, files, n):
        self.files, self.n = files, n

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        info = torchaudio.info(self.files[i])
        off = random.randint(0, max(0, info.num_frames - self.n))
        x, sr = torchaudio.load(self.files[i], frame_offset=off, num_frames=self.n)
        x = x[random.randrange(x.shape[0])][None]  # random channel
        x = F.pad(x, (0, self.n - x.shape[-1]))
        peak = x.abs().max()
        return x / peak * random.uniform(0.3, 0.95) if peak > 1e-3 else x


class Snake(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, ch, 1))

    def forward(self, x):
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


def wconv(*a, **k):
    return weight_norm(nn.Conv1d(*a, **k))


class Res(nn.Module):
    def __init__(self, ch, dil):
        super().__init__()
        self.net = nn.Sequential(Snake(ch), wconv(ch, ch, 7, dilation=dil, padding=3 * dil), Snake(ch), wconv(ch, ch, 1))

    def forward(self, x):
        return x + self.net(x)


class Encoder(nn.Module):
    def __init__(self, ch=64, strides=(2, 4, 8, 8), latent=1024):
        super().__init__()
        layers = [wconv(1, ch, 7, padding=3)]
        for s in strides:
            layers += [Res(ch, 1), Res(ch, 3), Res(ch, 9), Snake(ch),
                       wconv(ch, ch * 2, 2 * s, stride=s, padding=(s + 1) // 2)]
            ch *= 2
        layers += [Snake(ch), wconv(ch, latent, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, ch=1536, strides=(8, 8, 4, 2), latent=1024):
        super().__init__()
        layers = [wconv(latent, ch, 7, padding=3)]
        for s in strides:
            layers += [Snake(ch), weight_norm(nn.ConvTranspose1d(ch, ch // 2, 2 * s, stride=s, padding=(s + 1) // 2)),
                       Res(ch // 2, 1), Res(ch // 2, 3), Res(ch // 2, 9)]
            ch //= 2
        layers += [Snake(ch), wconv(ch, 1, 7, padding=3), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z)


class FactorisedVQ(nn.Module):
    def __init__(self, latent, size=1024, cdim=8):
        super().__init__()
        self.inp, self.out = wconv(latent, cdim, 1), wconv(cdim, latent, 1)
        self.codebook = nn.Embedding(size, cdim)

    def forward(self, z):
        ze = self.inp(z)
        flat = F.normalize(ze.transpose(1, 2).reshape(-1, ze.shape[1]), dim=-1)
        idx = (flat @ F.normalize(self.codebook.weight, dim=-1).t()).argmax(-1)
        zq = self.codebook(idx).view(ze.shape[0], ze.shape[2], -1).transpose(1, 2)
        loss = F.mse_loss(zq, ze.detach()) + 0.25 * F.mse_loss(ze, zq.detach())
        zq = ze + (zq - ze).detach()
        return self.out(zq), loss


class Codec(nn.Module):
    def __init__(self, n_q=9):
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder()
        self.quantizers = nn.ModuleList(FactorisedVQ(1024) for _ in range(n_q))

    def forward(self, x):
        z = self.encoder(x)
        res, zq, vq = z, torch.zeros_like(z), 0.0
        for q in self.quantizers:
            out, l = q(res)
            zq, res, vq = zq + out, res - out.detach(), vq + l
        return self.decoder(zq)[..., : x.shape[-1]], vq


class SpecDisc(nn.Module):
    def __init__(self, n_fft):
        super().__init__()
        self.n_fft = n_fft
        self.convs = nn.ModuleList(weight_norm(nn.Conv2d(ci, 32, (3, 9), stride=(1, st), padding=(1, 4)))
                                   for ci, st in ((1, 1), (32, 2), (32, 2), (32, 2)))
        self.post = weight_norm(nn.Conv2d(32, 1, 3, padding=1))

    def forward(self, x):
        w = torch.hann_window(self.n_fft, device=x.device)
        s = torch.stft(x.squeeze(1), self.n_fft, self.n_fft // 4, window=w, return_complex=True).abs()
        h, fm = s[:, None].clamp(min=1e-5).log(), []
        for c in self.convs:
            h = F.leaky_relu(c(h), 0.1)
            fm.append(h)
        return self.post(h), fm


class MRD(nn.Module):
    def __init__(self):
        super().__init__()
        self.ds = nn.ModuleList(SpecDisc(n) for n in (512, 1024, 2048))

    def forward(self, x):
        return [d(x) for d in self.ds]


def mel_distance(x, y, mels):
    return sum(F.l1_loss(m(x).clamp(min=1e-5).log10(), m(y).clamp(min=1e-5).log10()) for m in mels) / len(mels)


def load_checkpoint(path, gen, disc, opt_g, opt_d, sch_g, sch_d):
    ckpt = torch.load(path)
    gen.module.load_state_dict(ckpt["gen"])
    disc.module.load_state_dict(ckpt["disc"])
    opt_g.load_state_dict(ckpt["opt_g"])
    opt_d.load_state_dict(ckpt["opt_d"])
    sch_g.load_state_dict(ckpt["sch_g"])
    sch_d.load_state_dict(ckpt["sch_d"])
    return ckpt["step"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch-size", type=int, default=72, help="global")
    ap.add_argument("--crop", type=float, default=0.38)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--save-every", type=int, default=2500)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(rank)
    torch.manual_seed(rank)

    files = sorted(glob.glob(os.path.join(args.data, "**", "*.wav"), recursive=True))
    ds = Crops(files, int(args.crop * SR) // HOP * HOP)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size // world, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    gen = DDP(Codec().to(device), device_ids=[local_rank])
    disc = DDP(MRD().to(device), device_ids=[local_rank])
    opt_g = torch.optim.AdamW(gen.parameters(), args.lr, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), args.lr, betas=(0.8, 0.99))
    sch_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, 0.999996)
    sch_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, 0.999996)
    mels = nn.ModuleList(torchaudio.transforms.MelSpectrogram(SR, n_fft=n, hop_length=n // 4, n_mels=m)
                         for n, m in ((32, 5), (64, 10), (128, 20), (256, 40), (512, 80), (1024, 160), (2048, 320))
                         ).to(device)

    latest = os.path.join(args.run, "latest.pth")
    step = load_checkpoint(latest, gen, disc, opt_g, opt_d, sch_g, sch_d) if os.path.exists(latest) else 0
    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
        print(f"starting at step {step}", flush=True)

    epoch, t0 = step // len(dl), time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(device, non_blocking=True)
            y, vq = gen(x)

            outs = disc(torch.cat([x, y.detach()]))
            d_loss = sum(((1 - o.chunk(2)[0]) ** 2).mean() + (o.chunk(2)[1] ** 2).mean() for o, _ in outs)
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            torch.nn.utils.clip_grad_norm_(disc.parameters(), 10.0)
            opt_d.step()

            outs = disc(torch.cat([x, y]))
            adv = sum(((1 - o.chunk(2)[1]) ** 2).mean() for o, _ in outs)
            fm = sum(F.l1_loss(f.chunk(2)[1], f.chunk(2)[0].detach()) for _, fms in outs for f in fms)
            mel = mel_distance(y, x, mels)
            g_loss = 15.0 * mel + adv + 2.0 * fm + vq
            opt_g.zero_grad(set_to_none=True)
            g_loss.backward()
            torch.nn.utils.clip_grad_norm_(gen.parameters(), 1e3)
            opt_g.step()
            sch_g.step()
            sch_d.step()
            step += 1

            if step % 100 == 0:
                t = torch.stack([d_loss.detach(), mel.detach(), adv.detach(), fm.detach()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"{step} d {t[0]:.3f} mel {t[1]:.3f} adv {t[2]:.3f} fm {t[3]:.3f} "
                          f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

            if step % args.save_every == 0:
                if rank == 0:
                    state = {"gen": gen.module.state_dict(), "disc": disc.module.state_dict(),
                             "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                             "sch_g": sch_g.state_dict(), "sch_d": sch_d.state_dict(), "step": step}
                    torch.save(state, latest + ".partial")
                    os.replace(latest + ".partial", latest)
                    if step % (10 * args.save_every) == 0:
                        torch.save(gen.module.state_dict(), os.path.join(args.run, f"gen_{step:07d}.pth"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
