#!/usr/bin/env python
"""
Unconditional DDPM on LSUN-bedroom 128 with torch.compile, activation checkpointing and bf16.

    torchrun --standalone --nproc_per_node=8 13_uncond_ddpm_compile.py --data /data/lsun_bedroom_128 --run runs/bed128
"""
import argparse
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


def temb(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    a = t.float()[:, None] * f
    return torch.cat([a.sin(), a.cos()], dim=1)


class Res(nn.Module):
    def __init__(self, cin, cout, edim):
        super().__init__()
        self.block1 = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))
        self.emb = nn.Sequential(nn.SiLU(), nn.Linear(edim, cout))
        self.block2 = nn.Sequential(nn.GroupNorm(32, cout), nn.SiLU(), nn.Dropout(0.1), nn.Conv2d(cout, cout, 3, padding=1))
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, e):
        h = self.block1(x) + self.emb(e)[..., None, None]
        return self.skip(x) + self.block2(h)


class Attn(nn.Module):
    def __init__(self, c, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(32, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, 3, self.heads, C // self.heads, H * W).transpose(-1, -2).unbind(1)
        h = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(h.transpose(-1, -2).reshape(B, C, H, W))


class Level(nn.Module):
    def __init__(self, cin, cout, edim, attn):
        super().__init__()
        self.r1, self.r2 = Res(cin, cout, edim), Res(cout, cout, edim)
        self.attn = Attn(cout) if attn else nn.Identity()

    def forward(self, x, e):
        return self.attn(self.r2(self.r1(x, e), e))


class UNet(nn.Module):
    def __init__(self, ch=128, mults=(1, 1, 2, 3, 4), attn_levels=(3,), grad_ckpt=True):
        super().__init__()
        edim = 4 * ch
        self.ch, self.grad_ckpt = ch, grad_ckpt
        self.emb = nn.Sequential(nn.Linear(ch, edim), nn.SiLU(), nn.Linear(edim, edim))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        chs = [ch * m for m in mults]
        self.down, self.pool = nn.ModuleList(), nn.ModuleList()
        c = ch
        for i, co in enumerate(chs):
            self.down.append(Level(c, co, edim, i in attn_levels))
            self.pool.append(nn.Conv2d(co, co, 3, stride=2, padding=1) if i < len(chs) - 1 else nn.Identity())
            c = co
        self.mid = Level(c, c, edim, True)
        self.up, self.unpool = nn.ModuleList(), nn.ModuleList()
        for i, co in reversed(list(enumerate(chs))):
            self.unpool.append(nn.Upsample(scale_factor=2) if i < len(chs) - 1 else nn.Identity())
            self.up.append(Level(c + co, co, edim, i in attn_levels))
            c = co
        self.outp = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def _run(self, blk, x, e):
        if self.grad_ckpt and self.training:
            return checkpoint(blk, x, e, use_reentrant=False)
        return blk(x, e)

    def forward(self, x, t):
        e = self.emb(temb(t, self.ch))
        h = self.inp(x)
        skips = []
        for blk, pool in zip(self.down, self.pool):
            h = self._run(blk, h, e)
            skips.append(h)
            h = pool(h)
        h = self._run(self.mid, h, e)
        for blk, unpool in zip(self.up, self.unpool):
            h = unpool(h)
            h = self._run(blk, torch.cat([h, skips.pop()], 1), e)
        return self.outp(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run", default="runs/ddpm")
    ap.add_argument("--res", type=int, default=128)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--no_compile", action="store_true")
    ap.add_argument("--every", type=int, default=10_000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    tf = transforms.Compose([transforms.Resize(args.res), transforms.CenterCrop(args.res),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=8,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = UNet().to(dev)
    ema = deepcopy(net).eval().requires_grad_(False)
    ema.grad_ckpt = False
    ddp = DDP(net, device_ids=[local_rank])
    model = ddp if args.no_compile else torch.compile(ddp)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, device=dev, dtype=torch.float64), 0).float()

    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
    step, epoch, skipped, t0 = 0, 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, _ in dl:
            x = x.to(dev, non_blocking=True)
            t = torch.randint(0, 1000, (x.shape[0],), device=dev)
            n = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(a.sqrt() * x + (1 - a).sqrt() * n, t)
            loss = F.mse_loss(out.float(), n)

            # all ranks agree on skipping, otherwise the gradient all-reduce would go out of step
            ok = torch.isfinite(loss.detach()).to(torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if ok.item() == 0:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(net.parameters()), 1 - args.ema)
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} skipped {skipped} {100 / (time.time() - t0):.2f} it/s",
                          flush=True)
                t0 = time.time()

            if step % args.every == 0:
                if rank == 0:
                    torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "step": step}, os.path.join(args.run, "latest.pt"))
                    with torch.no_grad():
                        xs = torch.randn(16, 3, args.res, args.res, device=dev)
                        for i in reversed(range(0, 1000, 20)):
                            ab = abar[i]
                            ab_prev = abar[i - 20] if i >= 20 else torch.ones((), device=dev)
                            eps = ema(xs, torch.full((16,), i, device=dev))
                            x0 = ((xs - (1 - ab).sqrt() * eps) / ab.sqrt()).clamp(-1, 1)
                            xs = ab_prev.sqrt() * x0 + (1 - ab_prev).sqrt() * eps
                    save_image(xs * 0.5 + 0.5, os.path.join(args.run, f"sample_{step:07d}.png"), nrow=4)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
