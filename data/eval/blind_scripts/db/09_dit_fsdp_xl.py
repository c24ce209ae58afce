"""
DiT-XL/2 (675M) on ImageNet-512 latents with FSDP (FULL_SHARD, bf16 params/reduce).
Latents are pre-extracted into .npy shards (see LatentShards).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        09_dit_fsdp_xl.py --latent-dir /lustre/in512_latents --out /lustre/exp/dit_xl_512
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class LatentShards(Dataset):
    """Memory-mapped shards: latents_XXXX.npy [N,4,64,64] fp16 and labels_XXXX.npy [N]."""

    def __init__(self, root):
        self.latents = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(os.path.join(root, "latents_*.npy")))]
        self.labels = [np.load(f) for f in sorted(glob.glob(os.path.join(root, "labels_*.npy")))]
        assert len(self.latents) == len(self.labels) > 0
        self.offsets = np.cumsum([0] + [len(l) for l in self.labels])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = i - self.offsets[s]
        x = torch.from_numpy(np.array(self.latents[s][j], dtype=np.float32))
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, int(self.labels[s][j])


def timestep_features(t, dim=256):
    half = dim // 2
    f = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    a = t.float()[:, None] * f[None]
    return torch.cat([a.cos(), a.sin()], dim=-1)


class DiTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.ada = nn.Linear(d, 6 * d)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x, c):
        B, N, D = x.shape
        sa, ga, aa, sm, gm, am = self.ada(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + ga) + sa
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        x = x + aa * self.proj(h)
        h = self.norm2(x) * (1 + gm) + sm
        return x + am * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class DiT(nn.Module):
    def __init__(self, size=64, patch=2, in_ch=4, d=1152, depth=28, heads=16, num_classes=1000, p_uncond=0.1):
        super().__init__()
        self.size, self.patch, self.in_ch, self.num_classes, self.p_uncond = size, patch, in_ch, num_classes, p_uncond
        self.embed = nn.Conv2d(in_ch, d, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, d) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.y_emb = nn.Embedding(num_classes + 1, d)
        self.blocks = nn.ModuleList([DiTBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(d, 2 * d)
        self.head = nn.Linear(d, patch * patch * in_ch)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x, t, y):
        if self.training:
            drop = torch.rand_like(y, dtype=torch.float32) < self.p_uncond
            y = y.masked_fill(drop, self.num_classes)
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_mlp(timestep_features(t)) + self.y_emb(y)
        for b in self.blocks:
            h = b(h, c)
        s, g = self.ada(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        h = self.head(self.norm(h) * (1 + g) + s)
        n, p = self.size // self.patch, self.patch
        h = h.view(-1, n, n, p, p, self.in_ch).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(-1, self.in_ch, self.size, self.size)


def wrap(module, device_id):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DiTBlock})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDP(module, auto_wrap_policy=policy, mixed_precision=mp, device_id=device_id,
                sharding_strategy=ShardingStrategy.FULL_SHARD, limit_all_gathers=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latent-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-steps", type=int, default=400_000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--save-every", type=int, default=25_000)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed)
    model = wrap(DiT(), local_rank)
    ema = wrap(DiT(), local_rank)
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.copy_(p)
    ema.requires_grad_(False)
    torch.manual_seed(args.seed * world + rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0).float().to(device)

    ds = LatentShards(args.latent_dir)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} latents, world={world}, per-gpu batch {args.global_batch // world}", flush=True)

    step, epoch, tic = 0, 0, time.time()
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t = torch.randint(0, 1000, (x.shape[0],), device=device)
            noise = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            pred = model(a.sqrt() * x + (1 - a).sqrt() * noise, t, y)
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(p, 1 - args.ema)
            step += 1

            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} {args.log_every / (time.time() - tic):.2f} it/s", flush=True)
                tic = time.time()

            if step % args.save_every == 0 or step == args.max_steps:
                if rank == 0:
                    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                        model_sd = model.state_dict()
                    with FSDP.state_dict_type(ema, StateDictType.FULL_STATE_DICT, cfg):
                        ema_sd = ema.state_dict()
                    torch.save({"model": model_sd, "ema": ema_sd, "step": step},
                               os.path.join(args.out, f"dit_xl_{step:07d}.pt"))
                    print(f"saved step {step}", flush=True)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
