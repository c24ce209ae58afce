#!/usr/bin/env python
# DDPM on CIFAR-10 (Ho et al. 2020), multi-GPU with DistributedDataParallel.
#   torchrun --standalone --nproc_per_node=4 02_ddpm_cifar_unet.py --out runs/cifar_ddpm
import argparse
import copy
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.utils import save_image


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="runs/ddpm")
    p.add_argument("--ch", type=int, default=128)
    p.add_argument("--ch_mult", type=int, nargs="+", default=[1, 2, 2, 2])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--T", type=int, default=1000)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--batch_size", type=int, default=128, help="global batch size")
    p.add_argument("--epochs", type=int, default=2000)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--sample_every", type=int, default=5000)
    p.add_argument("--save_every", type=int, default=10000)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / (half - 1))
    emb = t.float()[:, None] * freqs[None]
    return torch.cat([emb.sin(), emb.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim, dropout):
        super().__init__()
        self.n1 = nn.GroupNorm(32, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2 = nn.GroupNorm(32, cout)
        self.drop = nn.Dropout(dropout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(F.silu(temb))[:, :, None, None]
        h = self.c2(self.drop(F.silu(self.n2(h))))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.norm = nn.GroupNorm(32, ch)
        self.qkv = nn.Conv2d(ch, ch * 3, 1)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(B, 3, C, H * W).unbind(1)
        h = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.proj(h.transpose(1, 2).reshape(B, C, H, W))


class UNet(nn.Module):
    def __init__(self, ch=128, ch_mult=(1, 2, 2, 2), attn_res=(16,), num_res=2, dropout=0.1, res=32):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.temb = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.head = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList()
        chans, cur = [ch], ch
        for i, m in enumerate(ch_mult):
            for _ in range(num_res):
                self.down.append(nn.ModuleList([ResBlock(cur, ch * m, tdim, dropout),
                                                AttnBlock(ch * m) if res in attn_res else nn.Identity()]))
                cur = ch * m
                chans.append(cur)
            if i != len(ch_mult) - 1:
                self.down.append(nn.Conv2d(cur, cur, 3, stride=2, padding=1))
                chans.append(cur)
                res //= 2
        self.mid1 = ResBlock(cur, cur, tdim, dropout)
        self.mid_attn = AttnBlock(cur)
        self.mid2 = ResBlock(cur, cur, tdim, dropout)
        self.up = nn.ModuleList()
        for i, m in reversed(list(enumerate(ch_mult))):
            for _ in range(num_res + 1):
                self.up.append(nn.ModuleList([ResBlock(cur + chans.pop(), ch * m, tdim, dropout),
                                              AttnBlock(ch * m) if res in attn_res else nn.Identity()]))
                cur = ch * m
            if i != 0:
                self.up.append(nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                             nn.Conv2d(cur, cur, 3, padding=1)))
                res *= 2
        self.tail = nn.Sequential(nn.GroupNorm(32, cur), nn.SiLU(), nn.Conv2d(cur, 3, 3, padding=1))

    def forward(self, x, t):
        temb = self.temb(timestep_embedding(t, self.ch))
        hs = [self.head(x)]
        h = hs[-1]
        for layer in self.down:
            if isinstance(layer, nn.ModuleList):
                h = layer[1](layer[0](h, temb))
            else:
                h = layer(h)
            hs.append(h)
        h = self.mid2(self.mid_attn(self.mid1(h, temb)), temb)
        for layer in self.up:
            if isinstance(layer, nn.ModuleList):
                h = layer[1](layer[0](torch.cat([h, hs.pop()], dim=1), temb))
            else:
                h = layer(h)
        return self.tail(h)


class DDPM:
    def __init__(self, T, device):
        self.T = T
        self.betas = torch.linspace(1e-4, 0.02, T, device=device)
        self.alphas = 1.0 - self.betas
        self.abar = torch.cumprod(self.alphas, 0)

    def loss(self, model, x0):
        t = torch.randint(0, self.T, (x0.size(0),), device=x0.device)
        noise = torch.randn_like(x0)
        ab = self.abar[t][:, None, None, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        return F.mse_loss(model(xt, t), noise)

    @torch.no_grad()
    def sample(self, model, n, device):
        x = torch.randn(n, 3, 32, 32, device=device)
        for i in reversed(range(self.T)):
            t = torch.full((n,), i, device=device, dtype=torch.long)
            eps = model(x, t)
            mean = (x - self.betas[i] / (1 - self.abar[i]).sqrt() * eps) / self.alphas[i].sqrt()
            x = mean + (self.betas[i].sqrt() * torch.randn_like(x) if i > 0 else 0)
        return x.clamp(-1, 1)


def ema_update(ema, model, decay):
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)
    is_main = rank == 0

    if is_main:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        writer = SummaryWriter(args.out)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    if is_main:
        datasets.CIFAR10(args.data, train=True, download=True)
    dist.barrier()
    train_set = datasets.CIFAR10(args.data, train=True, download=False, transform=tf)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    net = UNet(args.ch, tuple(args.ch_mult), dropout=args.dropout).to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(s, args.warmup) / args.warmup)
    diffusion = DDPM(args.T, device)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            loss = diffusion.loss(model, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            sched.step()
            ema_update(ema, net, args.ema_decay)
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                l /= world_size
                if is_main:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

            if step % args.sample_every == 0 and is_main:
                imgs = diffusion.sample(ema, 64, device)
                save_image(imgs * 0.5 + 0.5, os.path.join(args.out, "samples", f"{step:07d}.png"), nrow=8)

            if step % args.save_every == 0:
                if is_main:
                    torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.out, "ckpt.pt"))
                dist.barrier()
        if is_main:
            print(f"epoch {epoch} done, step {step} ({time.time() - t0:.1f}s)", flush=True)

    if is_main:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
