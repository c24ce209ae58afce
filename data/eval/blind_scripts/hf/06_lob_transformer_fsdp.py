"""Large limit-order-book transformer trained with FSDP.

Tokens are LOB snapshots (20 levels x [price, size] per side, plus order-flow
imbalance features); the model predicts the sign of the mid-price move over the
next 10/50/100 events as three 3-way classification heads.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        06_lob_transformer_fsdp.py --shards /lustre/lob/tokens --out /lustre/exp/lobt-1b
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
from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_FEAT = 86
HORIZONS = (10, 50, 100)


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--d-model", type=int, default=1536)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=2000)
    return p.parse_args()


class TokenShards(Dataset):
    """Memory-mapped .npy shards: feats (N, N_FEAT) float16, labels (N, 3) int8 in {0,1,2}."""

    def __init__(self, files, ctx):
        self.ctx = ctx
        self.feats = [np.load(f, mmap_mode="r") for f in files]
        self.labels = [np.load(f.replace("_feats", "_labels"), mmap_mode="r") for f in files]
        self.offsets = np.cumsum([0] + [len(a) // ctx for a in self.feats])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = (i - self.offsets[s]) * self.ctx
        x = torch.from_numpy(np.asarray(self.feats[s][j : j + self.ctx], dtype=np.float32))
        y = torch.from_numpy(np.asarray(self.labels[s][j : j + self.ctx], dtype=np.int64))
        return x, y, i


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LOBTransformer(nn.Module):
    def __init__(self, d, layers, heads, ctx):
        super().__init__()
        self.inp = nn.Linear(N_FEAT, d)
        self.pos = nn.Parameter(torch.zeros(1, ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.heads = nn.Linear(d, 3 * len(HORIZONS))
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, x):
        h = self.inp(x) + self.pos[:, : x.size(1)]
        for b in self.blocks:
            h = b(h, self.mask[: x.size(1), : x.size(1)])
        return self.heads(self.ln(h)).view(x.size(0), x.size(1), len(HORIZONS), 3)


def lr_at(step, total, warmup, base):
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, n_real, rank, world, device):
    # every rank runs the same number of forwards (FSDP all-gathers weights in each);
    # samples that DistributedSampler padded in are masked out of the metric
    model.eval()
    acc = torch.zeros(2 + len(HORIZONS), device=device, dtype=torch.float64)
    seen = 0
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x).float()
        pos = rank + world * torch.arange(seen, seen + len(x), device=device)
        valid = (pos < n_real).float()
        seen += len(x)
        nll = F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none").view(y.shape).mean((1, 2))
        hit = (logits.argmax(-1) == y).float().mean(1)  # (B, H)
        acc[0] += (nll * valid).sum()
        acc[1] += valid.sum()
        acc[2:] += (hit * valid[:, None]).sum(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item(), (acc[2:] / acc[1]).tolist()


def save_full(model, optim, step, out):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    if dist.get_rank() == 0:
        tmp = os.path.join(out, f"step{step:07d}.pt.tmp")
        torch.save({"model": msd, "optim": osd, "step": step}, tmp)
        os.replace(tmp, tmp[:-4])
    dist.barrier()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.shards, "*_feats.npy")))
    train_ds = TokenShards([f for f in files if "/val_" not in f], args.ctx)
    val_ds = TokenShards([f for f in files if "/val_" in f], args.ctx)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=False)
    train_loader = DataLoader(train_ds, args.micro_batch, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, args.micro_batch, sampler=val_sampler, num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    model = LOBTransformer(args.d_model, args.layers, args.heads, args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=bf16, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, use_orig_params=True, limit_all_gathers=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    total = args.epochs * len(train_loader)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} steps={total} train_seqs={len(train_ds)} params={n_params / 1e6:.0f}M", flush=True)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y, _ in train_loader:
            for g in optim.param_groups:
                g["lr"] = lr_at(step, total, args.warmup, args.lr)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 2), y.flatten())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"{50 * args.micro_batch * world / (time.time() - t0):.0f} seq/s", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                nll, hits = evaluate(model, val_loader, len(val_ds), rank, world, device)
                if rank == 0:
                    print(f"step {step} val_nll {nll:.4f} " +
                          " ".join(f"acc@{h}={a:.4f}" for h, a in zip(HORIZONS, hits)), flush=True)
                save_full(model, optim, step, args.out)

    save_full(model, optim, step, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
