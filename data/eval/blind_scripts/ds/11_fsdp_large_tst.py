"""Large time-series transformer (pretraining on all categories) sharded with FSDP.

~1.2B parameters at d_model=2048 / 24 layers, which no longer fits with
replicated Adam state, hence FULL_SHARD.

    torchrun --nproc_per_node=8 11_fsdp_large_tst.py --data /lake/retail/daily_panel.parquet \
        --out /lake/models/tst_large
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                    FullyShardedDataParallel as FSDP, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/lake/retail/daily_panel.parquet")
    p.add_argument("--out", default="/lake/models/tst_large")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--patch", type=int, default=14)
    p.add_argument("--ctx_patches", type=int, default=32)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--n_layers", type=int, default=24)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--origins", type=int, default=3)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, D // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, D))
        return x + self.mlp(self.ln2(x))


class LargeTST(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.patch = a.patch
        self.embed = nn.Linear(a.patch, a.d_model)
        self.pos = nn.Parameter(torch.zeros(1, a.ctx_patches, a.d_model))
        self.blocks = nn.ModuleList([Block(a.d_model, a.n_heads) for _ in range(a.n_layers)])
        self.ln = nn.LayerNorm(a.d_model)
        self.head = nn.Linear(a.d_model, a.horizon)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        h = self.embed(x.unflatten(-1, (-1, self.patch))) + self.pos
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h).mean(1))


class Windows(Dataset):
    def __init__(self, y, items, ctx, horizon):
        self.y, self.items, self.ctx, self.h = y, items, ctx, horizon

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, t = self.items[i]
        w = self.y[s, t - self.ctx:t + self.h]
        loc = w[:self.ctx].mean()
        scale = w[:self.ctx].std() + 1.0
        z = (w - loc) / scale
        return (torch.from_numpy(z[:self.ctx]), torch.from_numpy(z[self.ctx:]),
                torch.tensor([loc, scale]))


class PaddedToWorld(Dataset):
    """Pads an eval set to a multiple of the world size and flags the padding,
    so every rank runs the same number of FSDP forwards and padded rows are not counted."""

    def __init__(self, base, world):
        self.base = base
        self.n = len(base)
        self.total = math.ceil(self.n / world) * world

    def __len__(self):
        return self.total

    def __getitem__(self, i):
        x, y, ls = self.base[i % self.n]
        return x, y, ls, torch.tensor(i < self.n)


@torch.no_grad()
def backtest(model, loader, device):
    model.eval()
    s = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y, ls, valid in loader:
        x, y, ls, valid = x.to(device), y.to(device), ls.to(device), valid.to(device)
        pred = model(x).float()
        loc, scale = ls[:, :1], ls[:, 1:]
        p = (pred * scale + loc).clamp_min(0)
        t = y * scale + loc
        m = valid.unsqueeze(1).double()
        s[0] += ((p - t).abs().double() * m).sum()
        s[1] += (t.abs().double() * m).sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    panel = pd.read_parquet(args.data).pivot(index="series_id", columns="date", values="units")
    y = panel.fillna(0.0).to_numpy(np.float32)
    T = y.shape[1]
    ctx = args.patch * args.ctx_patches
    train_end = T - args.origins * args.horizon
    train_items = [(s, t) for s in range(len(y)) for t in range(ctx, train_end - args.horizon + 1, 7)]
    eval_items = [(s, T - k * args.horizon) for k in range(args.origins, 0, -1) for s in range(len(y))]

    train_ds = Windows(y, train_items, ctx, args.horizon)
    eval_ds = PaddedToWorld(Windows(y, eval_items, ctx, args.horizon), world)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=256, num_workers=4,
                             sampler=DistributedSampler(eval_ds, shuffle=False))

    model = LargeTST(args)
    ckpt = None
    if args.resume:
        ckpt = torch.load(os.path.join(args.out, "full.pt"), map_location="cpu")
        model.load_state_dict(ckpt["model"])

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.03)
    start_epoch = 0
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
        del ckpt

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"~{n_params / 1e9:.2f}B params (sharded), {len(loader)} steps/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for i, (x, yy, _) in enumerate(loader):
            x, yy = x.to(device, non_blocking=True), yy.to(device, non_blocking=True)
            loss = F.huber_loss(model(x).float(), yy)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and i % 500 == 0:
                print(f"ep {epoch} it {i} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(agg)
        wape = backtest(model, eval_loader, device)

        # every rank takes part in gathering the full state; only rank 0 gets and writes it
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            model_sd = model.state_dict()
            optim_sd = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} backtest wape {wape:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "epoch": epoch, "wape": wape,
                        "args": vars(args)}, os.path.join(args.out, "full.pt"))
        del model_sd, optim_sd
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
