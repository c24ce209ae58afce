"""Class-conditional DDPM (CIFAR-10) with classifier-free guidance.
FID is computed during training: each rank generates a slice of the batches, the
inception pool features are gathered and rank 0 computes the score.

torchrun --standalone --nproc_per_node=8 cfg_ddpm.py --data_root ./data --out runs/cfg_c10
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


class TEmb(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, 4 * d))

    def forward(self, t):
        half = self.d // 2
        f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
        a = t.float()[:, None] * f[None]
        return self.mlp(torch.cat([a.sin(), a.cos()], 1))


class RB(nn.Module):
    def __init__(self, ci, co, ed, drop=0.1):
        super().__init__()
        self.a = nn.Sequential(nn.GroupNorm(32, ci), nn.SiLU(), nn.Conv2d(ci, co, 3, 1, 1))
        self.e = nn.Linear(ed, co)
        self.b = nn.Sequential(nn.GroupNorm(32, co), nn.SiLU(), nn.Dropout(drop), nn.Conv2d(co, co, 3, 1, 1))
        self.s = nn.Conv2d(ci, co, 1) if ci != co else nn.Identity()

    def forward(self, x, e):
        return self.s(x) + self.b(self.a(x) + self.e(e)[:, :, None, None])


class Net(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 2), num_classes=10):
        super().__init__()
        ed = 4 * ch
        self.num_classes = num_classes
        self.temb = TEmb(ch)
        self.cemb = nn.Embedding(num_classes + 1, ed)
        self.inc = nn.Conv2d(3, ch, 3, 1, 1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        c, skips = ch, [ch]
        for i, m in enumerate(mult):
            for _ in range(2):
                self.down.append(RB(c, ch * m, ed)); c = ch * m; skips.append(c)
            if i < len(mult) - 1:
                self.down.append(nn.Conv2d(c, c, 3, 2, 1)); skips.append(c)
        self.mid = nn.ModuleList([RB(c, c, ed), RB(c, c, ed)])
        for i, m in reversed(list(enumerate(mult))):
            for _ in range(3):
                self.up.append(RB(c + skips.pop(), ch * m, ed)); c = ch * m
            if i > 0:
                self.up.append(nn.Upsample(scale_factor=2))
        self.outc = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, 1, 1))

    def forward(self, x, t, y):
        e = self.temb(t) + self.cemb(y)
        h = self.inc(x)
        hs = [h]
        for m in self.down:
            h = m(h, e) if isinstance(m, RB) else m(h)
            hs.append(h)
        for m in self.mid:
            h = m(h, e)
        for m in self.up:
            h = m(torch.cat([h, hs.pop()], 1), e) if isinstance(m, RB) else m(h)
        return self.outc(h)


def make_schedule(T, device):
    betas = torch.linspace(1e-4, 0.02, T, device=device)
    return betas, torch.cumprod(1 - betas, 0)


@torch.no_grad()
def ddim_cfg(net, y, abar, w, steps=100):
    x = torch.randn(len(y), 3, 32, 32, device=y.device)
    ts = torch.linspace(len(abar) - 1, 0, steps, device=y.device).long()
    null = torch.full_like(y, net.num_classes)
    for i, t in enumerate(ts):
        tt = t.repeat(len(y))
        e_c, e_u = net(torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([y, null])).chunk(2)
        eps = (1 + w) * e_c - w * e_u
        a = abar[t]
        a_next = abar[ts[i + 1]] if i + 1 < len(ts) else torch.ones_like(a)
        x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
        x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
    return x


@torch.no_grad()
def evaluate_fid(ema, inception, abar, ref_mu, ref_sigma, n_samples, bs, w, rank, world, device):
    n_batches = math.ceil(n_samples / bs)
    feats = []
    for b in range(rank, n_batches, world):
        cur = min(bs, n_samples - b * bs)
        y = torch.randint(0, ema.num_classes, (cur,), device=device)
        x = ddim_cfg(ema, y, abar, w)
        feats.append(inception((x + 1) / 2)[0].flatten(1))
    feats = torch.cat(feats)
    out = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(out, feats)
    if rank != 0:
        return None
    allf = torch.cat(out).double().cpu().numpy()
    return calculate_frechet_distance(allf.mean(0), np.cov(allf, rowvar=False), ref_mu, ref_sigma)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="./data")
    ap.add_argument("--out", default="runs/cfg")
    ap.add_argument("--fid_stats", default="stats/cifar10_train.npz")
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--total_steps", type=int, default=400_000)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--guidance", type=float, default=0.3)
    ap.add_argument("--fid_every", type=int, default=25_000)
    ap.add_argument("--fid_samples", type=int, default=10_000)
    ap.add_argument("--fid_bs", type=int, default=256)
    ap.add_argument("--ema", type=float, default=0.9999)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17 + rank)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    ds = datasets.CIFAR10(args.data_root, train=True, transform=tf, download=False)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    net = Net().to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5000))
    T = 1000
    _, abar = make_schedule(T, device)
    inception = InceptionV3([3]).to(device).eval()
    stats = np.load(args.fid_stats)
    ref_mu, ref_sigma = stats["mu"], stats["sigma"]

    step, epoch = 0, 0
    ck_file = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ck_file):
        ck = torch.load(ck_file, map_location=device)
        net.load_state_dict(ck["net"]); ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"]); warm.load_state_dict(ck["sched"]); step = ck["step"]
        epoch = step // len(loader)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    t0 = time.time()
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y = torch.where(torch.rand(y.shape, device=device) < args.p_uncond, torch.full_like(y, 10), y)
            t = torch.randint(0, T, (x.size(0),), device=device)
            n = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            loss = F.mse_loss(model(a.sqrt() * x + (1 - a).sqrt() * n, t, y), n)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            warm.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)
            step += 1

            if step % 500 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} ({(time.time() - t0) / 500:.3f}s/it)", flush=True)
                    t0 = time.time()

            if step % args.fid_every == 0:
                fid = evaluate_fid(ema, inception, abar, ref_mu, ref_sigma, args.fid_samples, args.fid_bs,
                                   args.guidance, rank, world, device)
                if rank == 0:
                    print(f"step {step} FID {fid:.3f}", flush=True)
                    with open(os.path.join(args.out, "fid.txt"), "a") as f:
                        f.write(f"{step} {fid:.4f}\n")
                    grid_y = torch.arange(10, device=device).repeat_interleave(8)
                    save_image(ddim_cfg(ema, grid_y, abar, args.guidance) * 0.5 + 0.5,
                               os.path.join(args.out, f"grid_{step:07d}.png"), nrow=8)
                    torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "sched": warm.state_dict(), "step": step}, ck_file)
                dist.barrier()
            if step >= args.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
