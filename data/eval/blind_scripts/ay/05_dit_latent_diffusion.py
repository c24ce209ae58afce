"""
DiT-B/2 class-conditional diffusion on pre-extracted SD-VAE latents (32x32x4).

torchrun --nproc_per_node=8 05_dit_latent_diffusion.py --latents /shared/latents/in1k_256 --results /shared/dit
"""
import argparse
import math
import os
import time
from collections import OrderedDict
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class LatentDataset(Dataset):
    def __init__(self, root):
        self.latents = np.load(os.path.join(root, "latents.npy"), mmap_mode="r")  # N,4,32,32 fp16
        self.labels = np.load(os.path.join(root, "labels.npy"))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = torch.from_numpy(np.array(self.latents[i], dtype=np.float32))
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, int(self.labels[i])


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(approximate="tanh"), nn.Linear(dim * 4, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), s1, sc1)
        B, N, C = h.shape
        q, k, v = self.qkv(h).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        x = x + g1.unsqueeze(1) * self.proj(h)
        x = x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, sc2))
        return x


class DiT(nn.Module):
    def __init__(self, in_ch=4, size=32, patch=2, dim=768, depth=12, heads=12, num_classes=1000):
        super().__init__()
        self.patch, self.in_ch, self.size = patch, in_ch, size
        self.x_embed = nn.Conv2d(in_ch, dim, patch, patch)
        n = (size // patch) ** 2
        self.pos = nn.Parameter(torch.zeros(1, n, dim), requires_grad=False)
        self.t_embed = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embed = nn.Embedding(num_classes + 1, dim)  # last index = null class for CFG
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.final = nn.Linear(dim, patch * patch * in_ch * 2)
        for blk in self.blocks:
            nn.init.zeros_(blk.ada[-1].weight)
            nn.init.zeros_(blk.ada[-1].bias)
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x, t, y):
        x = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_embed(timestep_embedding(t, 256)) + self.y_embed(y)
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        x = self.final(modulate(self.final_norm(x), shift, scale))
        B, p, h = x.size(0), self.patch, self.size // self.patch
        x = x.reshape(B, h, h, p, p, 2 * self.in_ch).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(B, 2 * self.in_ch, h * p, h * p)


def linear_alphas_cumprod(T=1000):
    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    return torch.cumprod(1 - betas, 0).float()


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    ema_p = OrderedDict(ema.named_parameters())
    for name, p in model.named_parameters():
        ema_p[name].mul_(decay).add_(p.data, alpha=1 - decay)


def reduce_stats(stats):
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--cfg-drop", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=10_000)
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 * world + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    assert args.global_batch % world == 0
    local_bs = args.global_batch // world

    model = DiT().to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    ema = deepcopy(model).requires_grad_(False)  # copy after DDP has broadcast rank 0's weights
    train_fn = torch.compile(ddp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    alphas_cumprod = linear_alphas_cumprod().to(device)

    ds = LatentDataset(args.latents)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=local_bs, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    if rank == 0:
        os.makedirs(os.path.join(args.results, "checkpoints"), exist_ok=True)
        print(f"DiT params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, {len(ds)} latents")

    step = 0
    stats = {"loss": 0.0, "n": 0, "imgs": 0}
    tic = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True).mul_(0.18215)
            y = y.to(device, non_blocking=True)
            y = torch.where(torch.rand(y.shape, device=device) < args.cfg_drop, torch.full_like(y, 1000), y)
            t = torch.randint(0, 1000, (x.size(0),), device=device)
            noise = torch.randn_like(x)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x + (1 - a).sqrt() * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = train_fn(xt, t, y)
            eps, _ = out.float().chunk(2, dim=1)
            loss = F.mse_loss(eps, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_ema(ema, model)
            step += 1
            stats["loss"] += loss.item()
            stats["n"] += 1
            stats["imgs"] += x.size(0)

            if step % args.log_every == 0:
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - tic
                tot = reduce_stats(stats)
                if rank == 0:
                    print(f"(step={step:07d}) loss {tot['loss'] / tot['n']:.4f} "
                          f"{tot['imgs'] / elapsed:.1f} img/s ({elapsed / args.log_every * 1e3:.0f} ms/step)")
                stats = {"loss": 0.0, "n": 0, "imgs": 0}
                tic = time.perf_counter()

            if step % args.ckpt_every == 0:
                if rank == 0:
                    ckpt = {"model": model.state_dict(), "ema": ema.state_dict(),
                            "opt": opt.state_dict(), "args": vars(args), "step": step}
                    torch.save(ckpt, os.path.join(args.results, "checkpoints", f"{step:07d}.pt"))
                dist.barrier()

    if rank == 0:
        torch.save({"ema": ema.state_dict()}, os.path.join(args.results, "checkpoints", "final_ema.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
