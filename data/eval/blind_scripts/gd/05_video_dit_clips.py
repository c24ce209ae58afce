#!/usr/bin/env python3
"""Video diffusion transformer, frame-clip training with sequence parallelism.

Latents for whole videos are cached as [C, T, H, W] fp16 tensors. Each step takes
a clip of `num_frames` latent frames, patchifies it into T*h*w tokens and splits
the tokens across an SP group; attention runs on all tokens via all-to-all.

torchrun --standalone --nproc_per_node=8 05_video_dit_clips.py \
    --latents /data/latents/webvid10m --sp-size 2 --num-frames 32
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distF
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class VideoLatents(Dataset):
    def __init__(self, root, num_frames):
        self.files = sorted(glob.glob(os.path.join(root, "*.pt")))
        self.num_frames = num_frames

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        item = torch.load(self.files[idx], map_location="cpu")
        lat = item["latent"]  # [C, T, H, W]
        T = lat.shape[1]
        if T >= self.num_frames:
            s = random.randint(0, T - self.num_frames)
            lat = lat[:, s:s + self.num_frames]
        else:
            pad = lat[:, -1:].expand(-1, self.num_frames - T, -1, -1)
            lat = torch.cat([lat, pad], dim=1)
        if random.random() < 0.5:
            lat = lat.flip(-1)
        return lat.float(), item["caption_emb"].float()


def seq_all_to_all(x, group, scatter_dim, gather_dim):
    n = dist.get_world_size(group)
    ins = [t.contiguous() for t in x.chunk(n, dim=scatter_dim)]
    outs = distF.all_to_all([torch.empty_like(ins[0]) for _ in range(n)], ins, group=group)
    return torch.cat(outs, dim=gather_dim)


class SPSelfAttention(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.heads, self.group = heads, group
        self.to_qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.LayerNorm(dim // heads)
        self.k_norm = nn.LayerNorm(dim // heads)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (seq_all_to_all(t, self.group, 2, 1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        o = seq_all_to_all(o.transpose(1, 2), self.group, 1, 2)
        return self.to_out(o.reshape(b, n, d))


class CrossAttention(nn.Module):
    """Each token attends to the (replicated) caption tokens; no communication needed."""

    def __init__(self, dim, ctx_dim, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(ctx_dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, ctx):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(ctx).view(b, ctx.size(1), 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, ctx_dim, heads, group):
        super().__init__()
        self.n1, self.n2, self.n3 = (nn.LayerNorm(dim, elementwise_affine=False) for _ in range(3))
        self.self_attn = SPSelfAttention(dim, heads, group)
        self.cross_attn = CrossAttention(dim, ctx_dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.mod = nn.Linear(dim, 6 * dim)

    def forward(self, x, c, ctx):
        sh1, sc1, g1, sh2, sc2, g2 = self.mod(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        x = x + g1 * self.self_attn(self.n1(x) * (1 + sc1) + sh1)
        x = x + self.cross_attn(self.n2(x), ctx)
        return x + g2 * self.ff(self.n3(x) * (1 + sc2) + sh2)


class VideoDiT(nn.Module):
    def __init__(self, in_ch, patch, dim, depth, heads, ctx_dim, group):
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(in_ch * patch * patch, dim)
        self.t_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, ctx_dim, heads, group) for _ in range(depth))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, in_ch * patch * patch)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, tokens, pos, t, ctx):
        half = 128
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        temb = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=-1)
        c = self.t_mlp(temb)
        x = self.embed(tokens) + pos
        for blk in self.blocks:
            x = blk(x, c, ctx)
        return self.proj_out(self.norm_out(x))


def to_tokens(z, p):
    b, c, t, h, w = z.shape
    z = z.reshape(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
    return z.reshape(b, t * (h // p) * (w // p), c * p * p)


def sincos_1d(n, dim, device):
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(n, dim, device=device)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--out", default="./runs/video_dit")
    ap.add_argument("--sp-size", type=int, default=2)
    ap.add_argument("--num-frames", type=int, default=32)
    ap.add_argument("--latent-hw", type=int, default=32)
    ap.add_argument("--patch", type=int, default=2)
    ap.add_argument("--dim", type=int, default=1152)
    ap.add_argument("--depth", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    seed_everything(args.seed + rank)

    sp = args.sp_size
    groups = [dist.new_group(list(range(s, s + sp))) for s in range(0, world, sp)]
    sp_group = groups[rank // sp]
    sp_rank, sp_src = rank % sp, (rank // sp) * sp
    dp_rank, dp_size = rank // sp, world // sp

    model = VideoDiT(4, args.patch, args.dim, args.depth, args.heads, 4096, sp_group).cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    ds = VideoLatents(args.latents, args.num_frames)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    hw = args.latent_hw // args.patch
    n_tok = args.num_frames * hw * hw
    assert n_tok % sp == 0
    local = n_tok // sp
    pos = sincos_1d(n_tok, args.dim, "cuda")[sp_rank * local:(sp_rank + 1) * local][None]
    alphas_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, device="cuda", dtype=torch.float64), 0).float()

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for z, ctx in loader:
            z, ctx = z.cuda(non_blocking=True), ctx.cuda(non_blocking=True)
            x0 = to_tokens(z * 0.18215, args.patch)[:, sp_rank * local:(sp_rank + 1) * local]
            t = torch.randint(0, 1000, (z.size(0),), device="cuda")
            dist.broadcast(t, src=sp_src, group=sp_group)
            eps = torch.randn_like(x0)
            ab = alphas_bar[t][:, None, None]
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, pos, t.float(), ctx)
            loss = F.mse_loss(pred.float(), eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                l /= world
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/sec_per_step", (time.time() - t0) / 50, step)
                    print(f"epoch {epoch} step {step} loss {l.item():.4f}", flush=True)
                t0 = time.time()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
