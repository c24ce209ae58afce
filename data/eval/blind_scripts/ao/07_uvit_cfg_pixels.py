# U-ViT style pixel-space diffusion on ImageNet-64 / CIFAR, class conditional with CFG.
# launch:  torchrun --standalone --nproc_per_node=4 train_uvit.py --data /data/imagenet64 --exp uvit_in64
import argparse
import copy
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Block(nn.Module):
    def __init__(self, dim, heads, skip=False):
        super().__init__()
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, skip=None):
        if self.skip_linear is not None:
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class UViT(nn.Module):
    def __init__(self, img_size=64, patch=4, in_ch=3, dim=512, depth=13, heads=8, num_classes=1000):
        super().__init__()
        self.patch, self.in_ch = patch, in_ch
        self.num_classes = num_classes
        self.patch_embed = nn.Conv2d(in_ch, dim, patch, patch)
        n = (img_size // patch) ** 2
        self.time_embed = nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))
        self.label_embed = nn.Embedding(num_classes, dim)
        self.pos = nn.Parameter(torch.zeros(1, 2 + n, dim))
        self.in_blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth // 2)])
        self.mid = Block(dim, heads)
        self.out_blocks = nn.ModuleList([Block(dim, heads, skip=True) for _ in range(depth // 2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, patch * patch * in_ch)
        self.final = nn.Conv2d(in_ch, in_ch, 3, padding=1)
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.null_token = nn.Parameter(torch.zeros(1, 1, dim))

    def forward(self, x, t, y=None):
        B = x.shape[0]
        h = self.patch_embed(x).flatten(2).transpose(1, 2)
        t_tok = self.time_embed(timestep_embedding(t, h.shape[-1])).unsqueeze(1)
        if y is not None:
            c_tok = self.label_embed(y).unsqueeze(1)
        else:
            c_tok = self.null_token.expand(B, -1, -1)
        h = torch.cat([t_tok, c_tok, h], dim=1) + self.pos
        skips = []
        for blk in self.in_blocks:
            h = blk(h)
            skips.append(h)
        h = self.mid(h)
        for blk in self.out_blocks:
            h = blk(h, skips.pop())
        h = self.head(self.norm(h))[:, 2:]
        side = int(math.sqrt(h.shape[1]))
        h = rearrange(h, "b (hh ww) (p1 p2 c) -> b c (hh p1) (ww p2)", hh=side, p1=self.patch, p2=self.patch)
        return self.final(h)


def cosine_alpha_bar(t):
    return torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2


@torch.no_grad()
def sample_cfg(net, labels, img_size, steps=100, w=1.5):
    """DDIM in continuous time with the cosine schedule."""
    dev = labels.device
    x = torch.randn(len(labels), 3, img_size, img_size, device=dev)
    ts = torch.linspace(1.0, 0.0, steps + 1, device=dev)
    for i in range(steps):
        t, s = ts[i], ts[i + 1]
        tt = (t * 999).round().long().repeat(len(x))
        eps_c = net(x, tt, labels)
        eps_u = net(x, tt, None)
        eps = (1 + w) * eps_c - w * eps_u
        a_t, a_s = cosine_alpha_bar(t), cosine_alpha_bar(s)
        x0 = ((x - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1, 1)
        x = a_s.sqrt() * x0 + (1 - a_s).sqrt() * eps
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", default="uvit")
    ap.add_argument("--img_size", type=int, default=64)
    ap.add_argument("--global_bs", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--wd", type=float, default=0.03)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--iters", type=int, default=300_000)
    ap.add_argument("--p_uncond", type=float, default=0.15)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    seed = args.seed + rank
    random.seed(seed); np.random.seed(seed); torch.manual_seed(seed)

    out_dir = os.path.join("experiments", args.exp)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(os.path.join(args.data, "train"), transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    bs = args.global_bs // world
    dl = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                    persistent_workers=True)

    net = UViT(img_size=args.img_size, num_classes=len(ds.classes)).to(dev)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.99, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / args.warmup))

    ck_path = os.path.join(out_dir, "ckpt.pth")
    it = 0
    if os.path.isfile(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["net"]); ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"]); sched.load_state_dict(ck["sched"]); it = ck["it"]
    net = DDP(net, device_ids=[local_rank])

    epoch = it // len(dl)
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x, y in dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            t = torch.rand(x.size(0), device=dev)
            a = cosine_alpha_bar(t).view(-1, 1, 1, 1)
            eps = torch.randn_like(x)
            xt = a.sqrt() * x + (1 - a).sqrt() * eps
            if random.random() < args.p_uncond:
                y = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = net(xt, (t * 999).round().long(), y)
                loss = F.mse_loss(pred.float(), eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.module.parameters()):
                    pe.mul_(args.ema).add_(p, alpha=1 - args.ema)
            it += 1

            if it % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"it {it} loss {l.item() / world:.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 200:.3f}s/it", flush=True)
                    t0 = time.time()

            if it % 10_000 == 0:
                if rank == 0:
                    labels = torch.arange(0, 1000, 1000 // 32, device=dev)[:32] % ema.num_classes
                    imgs = sample_cfg(ema, labels, args.img_size)
                    save_image(imgs * 0.5 + 0.5, os.path.join(out_dir, f"sample_{it:07d}.png"), nrow=8)
                    torch.save({"net": net.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "it": it}, ck_path)
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
