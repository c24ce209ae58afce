"""Latent video DiT (factorised space/time attention), class-conditional on UCF-101, trained with FSDP.

Latents are pre-extracted with the VAE (one .npy per video, shape [T, 4, 32, 32]); every step samples a clip
length from --frame_choices so the model sees variable-length clips.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
    05_video_dit_fsdp.py --latents /mnt/shared/ucf101_latents --out /mnt/shared/exp/vdit_b
"""
import argparse
import functools
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class LatentClips(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.items = json.load(f)  # [{"file": ..., "label": ...}, ...]
        self.root = root
        self.num_frames = 16

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        lat = np.load(os.path.join(self.root, it["file"]), mmap_mode="r")
        t = self.num_frames
        start = random.randint(0, max(0, lat.shape[0] - t))
        clip = torch.from_numpy(np.array(lat[start:start + t], dtype=np.float32))
        if clip.shape[0] < t:
            clip = torch.cat([clip, clip[-1:].expand(t - clip.shape[0], -1, -1, -1)], 0)
        return clip.permute(1, 0, 2, 3), it["label"]  # C T H W


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm_s = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn_s = Attention(dim, heads)
        self.norm_t = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn_t = Attention(dim, heads)
        self.norm_m = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(approximate="tanh"), nn.Linear(dim * 4, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 9))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, x, c, t):
        # x: (B*T, S, D)
        bt, s, d = x.shape
        b = bt // t
        mods = self.ada(c).repeat_interleave(t, 0).chunk(9, -1)
        x = x + mods[2].unsqueeze(1) * self.attn_s(modulate(self.norm_s(x), mods[0], mods[1]))
        xt = x.view(b, t, s, d).transpose(1, 2).reshape(b * s, t, d)
        mt = [m.view(b, t, d)[:, 0].repeat_interleave(s, 0) for m in mods[3:6]]
        xt = xt + mt[2].unsqueeze(1) * self.attn_t(modulate(self.norm_t(xt), mt[0], mt[1]))
        x = xt.view(b, s, t, d).transpose(1, 2).reshape(bt, s, d)
        x = x + mods[8].unsqueeze(1) * self.mlp(modulate(self.norm_m(x), mods[6], mods[7]))
        return x


class VideoDiT(nn.Module):
    def __init__(self, in_ch=4, size=32, patch=2, dim=768, depth=12, heads=12, num_classes=101):
        super().__init__()
        self.patch, self.in_ch, self.dim = patch, in_ch, dim
        self.grid = size // patch
        self.x_embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos_s = nn.Parameter(torch.zeros(1, self.grid * self.grid, dim))
        nn.init.normal_(self.pos_s, std=0.02)
        self.t_embed = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embed = nn.Embedding(num_classes + 1, dim)  # last index = unconditional
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 2))
        self.out = nn.Linear(dim, patch * patch * in_ch)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, timesteps, y):
        b, c, t, h, w = x.shape
        x = self.x_embed(x.transpose(1, 2).reshape(b * t, c, h, w)).flatten(2).transpose(1, 2)
        temb = timestep_embedding(torch.arange(t, device=x.device), self.dim)
        x = x + self.pos_s + temb.repeat(b, 1).unsqueeze(1).to(x.dtype)
        cond = self.t_embed(timestep_embedding(timesteps, 256).to(x.dtype)) + self.y_embed(y)
        for blk in self.blocks:
            x = blk(x, cond, t)
        shift, scale = self.ada_out(cond).repeat_interleave(t, 0).chunk(2, -1)
        x = self.out(modulate(self.norm_out(x), shift, scale))
        p, g = self.patch, self.grid
        x = x.view(b, t, g, g, p, p, c).permute(0, 6, 1, 2, 4, 3, 5).reshape(b, c, t, g * p, g * p)
        return x


def make_schedule(n=1000, device="cpu"):
    betas = torch.linspace(1e-4, 0.02, n, dtype=torch.float64)
    return torch.cumprod(1 - betas, 0).float().to(device)


def diffusion_loss(model, x0, y, alphas_cumprod, cfg_drop, num_classes):
    b = x0.shape[0]
    t = torch.randint(0, alphas_cumprod.shape[0], (b,), device=x0.device)
    noise = torch.randn_like(x0)
    a = alphas_cumprod[t].view(b, 1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    y = torch.where(torch.rand(b, device=y.device) < cfg_drop, torch.full_like(y, num_classes), y)
    return F.mse_loss(model(xt, t, y).float(), noise)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=400000)
    ap.add_argument("--frame_choices", default="4,8,12,16")
    ap.add_argument("--cfg_drop", type=float, default=0.1)
    ap.add_argument("--latent_scale", type=float, default=0.18215)
    ap.add_argument("--init", default="")
    ap.add_argument("--save_every", type=int, default=10000)
    ap.add_argument("--val_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = VideoDiT()
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu"))
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DiTBlock})
    model = FSDP(model, auto_wrap_policy=wrap, device_id=local_rank, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 sync_module_states=bool(args.init), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    torch.manual_seed(1000 + rank)  # different noise / timesteps per rank
    alphas_cumprod = make_schedule(device=device)

    train_set, val_set = LatentClips(args.latents, "train"), LatentClips(args.latents, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.global_batch // world, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=val_sampler, num_workers=4)
    frame_choices = [int(v) for v in args.frame_choices.split(",")]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"params: {sum(p.numel() for p in model.parameters()) * world / 1e6:.1f}M (approx), world {world}")

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x0, y in loader:
            nf = random.Random(step).choice(frame_choices)  # same on every rank
            x0 = x0[:, :, :nf].to(device, non_blocking=True) * args.latent_scale
            y = y.to(device, non_blocking=True)
            loss = diffusion_loss(model, x0, y, alphas_cumprod, args.cfg_drop, 101)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} nf {nf} loss {l.item():.4f}", flush=True)

            if step % args.val_every == 0:
                model.eval()
                g = torch.Generator(device=device).manual_seed(rank)
                tot = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vx, vy in val_loader:
                        vx, vy = vx.to(device) * args.latent_scale, vy.to(device)
                        tt = torch.randint(0, 1000, (vx.shape[0],), device=device, generator=g)
                        nz = torch.randn(vx.shape, device=device, generator=g)
                        a = alphas_cumprod[tt].view(-1, 1, 1, 1, 1)
                        pred = model(a.sqrt() * vx + (1 - a).sqrt() * nz, tt, vy)
                        tot[0] += F.mse_loss(pred.float(), nz, reduction="sum") / nz[0].numel()
                        tot[1] += vx.shape[0]
                dist.all_reduce(tot)
                if rank == 0:
                    print(f"step {step} val loss {(tot[0] / tot[1]).item():.4f}", flush=True)
                model.train()

            if step % args.save_every == 0 or step == args.steps:
                if rank == 0:
                    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                        full = model.state_dict()
                    torch.save(full, os.path.join(args.out, f"dit_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
