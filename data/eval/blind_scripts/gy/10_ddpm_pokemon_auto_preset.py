#!/usr/bin/env python3
"""
Small DDPM on 64x64 pokemon sprites (~7k pngs in ~/data/pokemon64 on each box).

  main box : RTX 3090 24GB   (192.168.1.60)
  old box  : RTX 3060 Ti 8GB (192.168.1.61)

  torchrun --nnodes 2 --nproc_per_node 1 --node_rank N \
      --master_addr 192.168.1.60 --master_port 29555 ddpm_pokemon.py --preset auto
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms, utils

PRESETS = {
    "large": dict(base=128, mults=(1, 2, 3, 4), attn_res=(16, 8)),
    "medium": dict(base=96, mults=(1, 2, 2, 4), attn_res=(16,)),
    "small": dict(base=64, mults=(1, 2, 2, 2), attn_res=(16,)),
}


def pick_preset(name, device):
    if name != "auto":
        return name
    vram = torch.cuda.get_device_properties(device).total_memory / 2**30
    if vram >= 20:
        return "large"
    if vram >= 11:
        return "medium"
    return "small"


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1 = nn.GroupNorm(32, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2 = nn.GroupNorm(32, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(temb)[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return h + self.skip(x)


class Attn(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.norm = nn.GroupNorm(32, ch)
        self.qkv = nn.Conv2d(ch, ch * 3, 1)
        self.out = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(B, 3, C, H * W).unbind(1)
        h = F.scaled_dot_product_attention(q.transpose(1, 2)[:, None], k.transpose(1, 2)[:, None],
                                           v.transpose(1, 2)[:, None])[:, 0]
        return x + self.out(h.transpose(1, 2).reshape(B, C, H, W))


class UNet(nn.Module):
    def __init__(self, base, mults, attn_res, img=64):
        super().__init__()
        tdim = base * 4
        self.base = base
        self.temb = nn.Sequential(nn.Linear(base, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inc = nn.Conv2d(3, base, 3, padding=1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        chans, ch, res = [base], base, img
        for i, m in enumerate(mults):
            out = base * m
            blk = nn.ModuleList([ResBlock(ch, out, tdim), Attn(out) if res in attn_res else nn.Identity()])
            self.down.append(blk)
            ch = out
            chans.append(ch)
            if i < len(mults) - 1:
                self.down.append(nn.Conv2d(ch, ch, 3, stride=2, padding=1))
                res //= 2
        self.mid1 = ResBlock(ch, ch, tdim)
        self.mid_attn = Attn(ch)
        self.mid2 = ResBlock(ch, ch, tdim)
        for i, m in reversed(list(enumerate(mults))):
            out = base * m
            skip = chans.pop()
            self.up.append(nn.ModuleList([ResBlock(ch + skip, out, tdim),
                                          Attn(out) if res in attn_res else nn.Identity()]))
            ch = out
            if i > 0:
                self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
                res *= 2
        self.outc = nn.Sequential(nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x, t):
        temb = self.temb(timestep_embedding(t, self.base))
        h = self.inc(x)
        skips = []
        for layer in self.down:
            if isinstance(layer, nn.ModuleList):
                h = layer[1](layer[0](h, temb))
                skips.append(h)
            else:
                h = layer(h)
        h = self.mid2(self.mid_attn(self.mid1(h, temb)), temb)
        for layer in self.up:
            if isinstance(layer, nn.ModuleList):
                h = layer[1](layer[0](torch.cat([h, skips.pop()], 1), temb))
            else:
                h = layer(h)
        return self.outc(h)


class Diffusion:
    def __init__(self, T=1000, device="cuda"):
        self.T = T
        betas = torch.linspace(1e-4, 0.02, T, device=device)
        self.alphas = 1 - betas
        self.abar = torch.cumprod(self.alphas, 0)
        self.betas = betas

    def q_sample(self, x0, t, noise):
        a = self.abar[t][:, None, None, None]
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    @torch.no_grad()
    def sample(self, net, n, device):
        x = torch.randn(n, 3, 64, 64, device=device)
        for i in reversed(range(self.T)):
            t = torch.full((n,), i, device=device, dtype=torch.long)
            eps = net(x, t)
            a, ab, b = self.alphas[i], self.abar[i], self.betas[i]
            x = (x - b / (1 - ab).sqrt() * eps) / a.sqrt()
            if i > 0:
                x = x + b.sqrt() * torch.randn_like(x)
        return x.clamp(-1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/pokemon64"))
    ap.add_argument("--preset", default="auto", choices=["auto", *PRESETS])
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--sample-every", type=int, default=25)
    ap.add_argument("--out", default="ddpm_out")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    preset = pick_preset(args.preset, device)
    net = UNet(**PRESETS[preset]).to(device)
    print(f"[rank {rank}] preset={preset} params={sum(p.numel() for p in net.parameters()) / 1e6:.1f}M",
          flush=True)
    model = DDP(net, device_ids=[local_rank])
    ema = UNet(**PRESETS[preset]).to(device).eval().requires_grad_(False)
    ema.load_state_dict(net.state_dict())

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    diff = Diffusion(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, _ in dl:
            x = x.to(device, non_blocking=True)
            t = torch.randint(0, diff.T, (x.size(0),), device=device)
            noise = torch.randn_like(x)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(diff.q_sample(x, t, noise), t), noise)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(pm, 1 - 0.999)
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {tot[0] / tot[1]:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % args.sample_every == 0:
                imgs = diff.sample(ema, 16, device)
                utils.save_image(imgs * 0.5 + 0.5, os.path.join(args.out, f"e{epoch + 1:04d}.png"), nrow=4)
                torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "preset": preset,
                            "epoch": epoch}, os.path.join(args.out, "ddpm.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
