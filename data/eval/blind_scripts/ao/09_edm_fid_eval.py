"""EDM (Karras et al. 2022) preconditioning + Heun sampler, small ADM-ish UNet.
FID-10k against precomputed reference stats every `fid_every` kimg.

torchrun --nproc_per_node=8 edm_train.py --data /data/afhqv2-64 --ref stats/afhqv2-64.npz --outdir runs/edm_afhq
"""
import argparse
import copy
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch_fid.fid_score import calculate_frechet_distance
from pytorch_fid.inception import InceptionV3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


class FourierEmb(nn.Module):
    def __init__(self, dim, scale=16):
        super().__init__()
        self.register_buffer("freqs", torch.randn(dim // 2) * scale)

    def forward(self, x):
        x = x.outer(2 * math.pi * self.freqs)
        return torch.cat([x.cos(), x.sin()], dim=1)


class RB(nn.Module):
    def __init__(self, ci, co, edim, attn=False):
        super().__init__()
        self.n0, self.c0 = nn.GroupNorm(32, ci), nn.Conv2d(ci, co, 3, 1, 1)
        self.aff = nn.Linear(edim, 2 * co)
        self.n1, self.c1 = nn.GroupNorm(32, co), nn.Conv2d(co, co, 3, 1, 1)
        self.skip = nn.Conv2d(ci, co, 1) if ci != co else nn.Identity()
        self.attn = nn.MultiheadAttention(co, 4, batch_first=True) if attn else None
        nn.init.zeros_(self.c1.weight)

    def forward(self, x, e):
        h = self.c0(F.silu(self.n0(x)))
        s, b = self.aff(e)[:, :, None, None].chunk(2, 1)
        h = self.c1(F.silu(self.n1(h) * (1 + s) + b))
        x = (self.skip(x) + h) / math.sqrt(2)
        if self.attn is not None:
            B, C, H, W = x.shape
            q = x.flatten(2).transpose(1, 2)
            x = x + self.attn(q, q, q, need_weights=False)[0].transpose(1, 2).reshape(B, C, H, W)
        return x


class UNet(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 2, 2), attn_at=(16,), res=64):
        super().__init__()
        edim = 4 * ch
        self.emb = nn.Sequential(FourierEmb(ch), nn.Linear(ch, edim), nn.SiLU(), nn.Linear(edim, edim))
        self.inp = nn.Conv2d(3, ch, 3, 1, 1)
        self.enc, self.dec = nn.ModuleList(), nn.ModuleList()
        skips, c, r = [ch], ch, res
        for i, m in enumerate(mult):
            if i:
                self.enc.append(nn.Conv2d(c, c, 3, 2, 1)); skips.append(c); r //= 2
            for _ in range(2):
                self.enc.append(RB(c, ch * m, edim, attn=r in attn_at)); c = ch * m; skips.append(c)
        self.mid = nn.ModuleList([RB(c, c, edim, attn=True), RB(c, c, edim)])
        for i, m in reversed(list(enumerate(mult))):
            for _ in range(3):
                self.dec.append(RB(c + skips.pop(), ch * m, edim, attn=r in attn_at)); c = ch * m
            if i:
                self.dec.append(nn.Upsample(scale_factor=2)); r *= 2
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, 1, 1))

    def forward(self, x, noise_label):
        e = self.emb(noise_label)
        h = self.inp(x)
        hs = [h]
        for m in self.enc:
            h = m(h, e) if isinstance(m, RB) else m(h)
            hs.append(h)
        for m in self.mid:
            h = m(h, e)
        for m in self.dec:
            h = m(torch.cat([h, hs.pop()], 1), e) if isinstance(m, RB) else m(h)
        return self.out(h)


class EDMPrecond(nn.Module):
    def __init__(self, net, sigma_data=0.5):
        super().__init__()
        self.net, self.sd = net, sigma_data

    def forward(self, x, sigma):
        sigma = sigma.view(-1, 1, 1, 1)
        c_skip = self.sd ** 2 / (sigma ** 2 + self.sd ** 2)
        c_out = sigma * self.sd / (sigma ** 2 + self.sd ** 2).sqrt()
        c_in = 1 / (self.sd ** 2 + sigma ** 2).sqrt()
        F_x = self.net(c_in * x, sigma.flatten().log() / 4)
        return c_skip * x + c_out * F_x


def edm_loss(D, x, P_mean=-1.2, P_std=1.2, sd=0.5):
    sigma = (torch.randn(x.shape[0], device=x.device) * P_std + P_mean).exp()
    w = ((sigma ** 2 + sd ** 2) / (sigma * sd) ** 2).view(-1, 1, 1, 1)
    n = torch.randn_like(x) * sigma.view(-1, 1, 1, 1)
    return (w * (D(x + n, sigma) - x) ** 2).mean()


@torch.no_grad()
def heun_sample(D, latents, steps=18, smin=0.002, smax=80, rho=7):
    i = torch.arange(steps, device=latents.device, dtype=torch.float64)
    t = (smax ** (1 / rho) + i / (steps - 1) * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho
    t = torch.cat([t, torch.zeros_like(t[:1])])
    x = latents.double() * t[0]
    for k in range(steps):
        tc, tn = t[k], t[k + 1]
        d = (x - D(x.float(), tc.float().repeat(len(x))).double()) / tc
        xn = x + (tn - tc) * d
        if k < steps - 1:
            d2 = (xn - D(xn.float(), tn.float().repeat(len(x))).double()) / tn
            xn = x + (tn - tc) * (0.5 * d + 0.5 * d2)
        x = xn
    return x.float().clamp(-1, 1)


@torch.no_grad()
def compute_fid(D, inception, ref_mu, ref_sigma, n_total, batch, rank, world, device, seed=0):
    per_rank = n_total // world
    g = torch.Generator(device=device).manual_seed(seed + rank)
    feats = []
    for s in range(0, per_rank, batch):
        b = min(batch, per_rank - s)
        z = torch.randn(b, 3, 64, 64, device=device, generator=g)
        img = (heun_sample(D, z) + 1) / 2
        feats.append(inception(img)[0].squeeze(-1).squeeze(-1).double().cpu())
    feats = torch.cat(feats).numpy()
    mu, sigma = feats.mean(0), np.cov(feats, rowvar=False)
    return float(calculate_frechet_distance(mu, sigma, ref_mu, ref_sigma))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ref", required=True, help="npz with mu / sigma of the dataset")
    ap.add_argument("--outdir", default="runs/edm")
    ap.add_argument("--batch", type=int, default=256, help="total batch")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--kimg", type=int, default=100_000)
    ap.add_argument("--ema_halflife_kimg", type=float, default=500)
    ap.add_argument("--tick_kimg", type=int, default=50)
    ap.add_argument("--fid_every_ticks", type=int, default=20)
    ap.add_argument("--fid_n", type=int, default=10_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    torch.backends.cudnn.benchmark = True

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    net = EDMPrecond(UNet()).to(device)
    ddp = DDP(net, device_ids=[local_rank])  # broadcasts rank 0's weights + fourier freqs
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)

    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    ref = np.load(args.ref)
    ref_mu, ref_sigma = ref["mu"], ref["sigma"]

    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        log = open(os.path.join(args.outdir, "log.txt"), "a")

    nimg, tick, epoch = 0, 0, 0
    tick_start, t0 = 0, time.time()
    loss_acc = torch.zeros((), device=device)
    n_acc = 0
    while nimg < args.kimg * 1000:
        sampler.set_epoch(epoch)
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            loss = edm_loss(ddp, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for g in opt.param_groups:
                g["lr"] = args.lr * min(nimg / 10e6, 1) if nimg > 0 else args.lr * 1e-3
            for p in net.parameters():
                if p.grad is not None:
                    torch.nan_to_num(p.grad, nan=0, posinf=1e5, neginf=-1e5, out=p.grad)
            opt.step()
            nimg += args.batch
            beta = 0.5 ** (args.batch / max(args.ema_halflife_kimg * 1000, 1e-8))
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.copy_(p.detach().lerp(pe, beta))
            loss_acc += loss.detach()
            n_acc += 1

            if nimg >= tick_start + args.tick_kimg * 1000:
                tick += 1
                tick_start = nimg
                dist.all_reduce(loss_acc)
                mean_loss = loss_acc.item() / (n_acc * world)
                loss_acc.zero_()
                n_acc = 0
                fid = None
                if tick % args.fid_every_ticks == 0:
                    fid = compute_fid(ema, inception, ref_mu, ref_sigma, args.fid_n, 128, rank, world, device)
                if rank == 0:
                    msg = f"tick {tick} kimg {nimg / 1000:.1f} loss {mean_loss:.4f} sec/tick {time.time() - t0:.0f}"
                    if fid is not None:
                        msg += f" fid10k {fid:.2f}"
                    print(msg, flush=True)
                    log.write(msg + "\n"); log.flush()
                    with torch.no_grad():
                        grid = heun_sample(ema, torch.randn(64, 3, 64, 64, device=device, generator=torch.Generator(device=device).manual_seed(7)))
                    save_image(grid * 0.5 + 0.5, os.path.join(args.outdir, f"grid_{tick:05d}.png"), nrow=8)
                    torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "nimg": nimg}, os.path.join(args.outdir, f"snapshot_{tick:05d}.pt"))
                dist.barrier()
                t0 = time.time()
            if nimg >= args.kimg * 1000:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
