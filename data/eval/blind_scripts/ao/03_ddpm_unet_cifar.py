#!/usr/bin/env python
# DDPM (Ho et al. 2020) on CIFAR-10 / CelebA-64, eps-prediction, linear schedule.
# multi-gpu: torchrun --standalone --nproc_per_node=4 ddpm_train.py --data cifar10 --out runs/ddpm_c10
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image


# ---------------------------------------------------------------- model
def timestep_embedding(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / (half - 1))
    e = t.float()[:, None] * f[None]
    return torch.cat([e.sin(), e.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim, dropout=0.1):
        super().__init__()
        self.block1 = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))
        self.temb = nn.Sequential(nn.SiLU(), nn.Linear(tdim, cout))
        self.block2 = nn.Sequential(nn.GroupNorm(32, cout), nn.SiLU(), nn.Dropout(dropout),
                                    nn.Conv2d(cout, cout, 3, padding=1))
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.block1(x)
        h = h + self.temb(temb)[:, :, None, None]
        h = self.block2(h)
        return h + self.shortcut(x)


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(32, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(B, 3, C, H * W).unbind(1)
        h = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.proj(h.transpose(1, 2).reshape(B, C, H, W))


class UNet(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 2, 2), attn_res=(16,), num_res=2, img=32, dropout=0.1):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.temb = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.head = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList()
        chans = [ch]
        cur, res = ch, img
        for i, m in enumerate(mult):
            for _ in range(num_res):
                blk = nn.ModuleList([ResBlock(cur, ch * m, tdim, dropout)])
                cur = ch * m
                if res in attn_res:
                    blk.append(AttnBlock(cur))
                self.down.append(blk)
                chans.append(cur)
            if i != len(mult) - 1:
                self.down.append(nn.ModuleList([nn.Conv2d(cur, cur, 3, stride=2, padding=1)]))
                chans.append(cur)
                res //= 2
        self.mid = nn.ModuleList([ResBlock(cur, cur, tdim, dropout), AttnBlock(cur), ResBlock(cur, cur, tdim, dropout)])
        self.up = nn.ModuleList()
        for i, m in reversed(list(enumerate(mult))):
            for _ in range(num_res + 1):
                blk = nn.ModuleList([ResBlock(cur + chans.pop(), ch * m, tdim, dropout)])
                cur = ch * m
                if res in attn_res:
                    blk.append(AttnBlock(cur))
                self.up.append(blk)
            if i != 0:
                self.up.append(nn.ModuleList([nn.Upsample(scale_factor=2), nn.Conv2d(cur, cur, 3, padding=1)]))
                res *= 2
        self.tail = nn.Sequential(nn.GroupNorm(32, cur), nn.SiLU(), nn.Conv2d(cur, 3, 3, padding=1))

    def forward(self, x, t):
        temb = self.temb(timestep_embedding(t, self.ch))
        h = self.head(x)
        hs = [h]
        for blk in self.down:
            if isinstance(blk[0], ResBlock):
                h = blk[0](h, temb)
                for extra in blk[1:]:
                    h = extra(h)
            else:
                h = blk[0](h)
            hs.append(h)
        h = self.mid[0](h, temb)
        h = self.mid[1](h)
        h = self.mid[2](h, temb)
        for blk in self.up:
            if isinstance(blk[0], ResBlock):
                h = blk[0](torch.cat([h, hs.pop()], 1), temb)
                for extra in blk[1:]:
                    h = extra(h)
            else:
                for layer in blk:
                    h = layer(h)
        return self.tail(h)


# ---------------------------------------------------------------- diffusion
class Diffusion:
    def __init__(self, T=1000, device="cpu"):
        self.T = T
        self.betas = torch.linspace(1e-4, 0.02, T, device=device)
        self.alphas = 1 - self.betas
        self.abar = torch.cumprod(self.alphas, 0)

    def q_sample(self, x0, t, noise):
        a = self.abar[t].view(-1, 1, 1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    @torch.no_grad()
    def sample(self, net, n, device, img=32):
        x = torch.randn(n, 3, img, img, device=device)
        for i in reversed(range(self.T)):
            t = torch.full((n,), i, device=device, dtype=torch.long)
            eps = net(x, t)
            a, ab, b = self.alphas[i], self.abar[i], self.betas[i]
            mean = (x - b / (1 - ab).sqrt() * eps) / a.sqrt()
            x = mean + (b.sqrt() * torch.randn_like(x) if i > 0 else 0)
        return x.clamp(-1, 1)


def ema_update(ema, net, decay):
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), net.parameters()):
            pe.lerp_(p, 1 - decay)


def build_data(name, root, train):
    tf = T.Compose([T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    if name == "cifar10":
        return torchvision.datasets.CIFAR10(root, train=train, download=False, transform=tf)
    tf = T.Compose([T.Resize(64), T.CenterCrop(64), tf])
    return torchvision.datasets.ImageFolder(os.path.join(root, "train" if train else "val"), transform=tf)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="cifar10")
    ap.add_argument("--root", default="./data")
    ap.add_argument("--out", default="runs/ddpm")
    ap.add_argument("--batch", type=int, default=128, help="global batch")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--grad_clip", type=float, default=1.0)
    ap.add_argument("--sample_every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    is_main = rank == 0

    train_set = build_data(args.data, args.root, train=True)
    val_set = build_data(args.data, args.root, train=False)
    img = 32 if args.data == "cifar10" else 64
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    per_gpu = args.batch // world
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=per_gpu, sampler=val_sampler, num_workers=args.workers)

    torch.manual_seed(0)
    net = UNet(img=img).to(dev)
    torch.manual_seed(1 + rank)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    diff = Diffusion(device=dev)

    ckpt_path = os.path.join(args.out, "ckpt.pt")
    start_epoch, step = 0, 0
    if args.resume and os.path.exists(ckpt_path):
        sd = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(sd["net"])
        ema.load_state_dict(sd["ema"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        start_epoch, step = sd["epoch"] + 1, sd["step"]
    net = DDP(net, device_ids=[local_rank])

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, per-gpu batch {per_gpu}, {len(train_loader)} it/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        net.train()
        t0 = time.time()
        tot = torch.zeros(2, device=dev)
        for x, _ in train_loader:
            x = x.to(dev, non_blocking=True)
            t = torch.randint(0, diff.T, (x.size(0),), device=dev)
            noise = torch.randn_like(x)
            loss = F.mse_loss(net(diff.q_sample(x, t, noise), t), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), args.grad_clip)
            opt.step()
            sched.step()
            ema_update(ema, net.module, args.ema)
            tot += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=dev)])
            step += 1

        # held-out denoising loss at a few fixed timesteps
        net.eval()
        val = torch.zeros(2, device=dev)
        g = torch.Generator(device=dev).manual_seed(1234 + rank)
        with torch.no_grad():
            for x, _ in val_loader:
                x = x.to(dev)
                t = torch.randint(0, diff.T, (x.size(0),), device=dev, generator=g)
                noise = torch.randn(x.shape, device=dev, generator=g)
                l = F.mse_loss(ema(diff.q_sample(x, t, noise), t), noise, reduction="sum") / x[0].numel()
                val += torch.stack([l, torch.tensor(float(x.size(0)), device=dev)])
        dist.all_reduce(tot)
        dist.all_reduce(val)

        if is_main:
            print(f"epoch {epoch} step {step} train {tot[0] / tot[1]:.4f} val(ema) {val[0] / val[1]:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            if epoch % args.sample_every == 0:
                xs = diff.sample(ema, 64, dev, img)
                save_image(xs * 0.5 + 0.5, os.path.join(args.out, f"sample_{epoch:05d}.png"), nrow=8)
            torch.save({"net": net.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
