# PatchTST-style channel-independent transformer for weekly category demand.
#
# Launch (single node, 4 GPUs):
#   torchrun --standalone --nproc_per_node=4 02_patch_tst_backtest.py \
#       --config configs/patchtst_weekly.yaml
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    data="/data/retail/weekly_category.csv",
    out_dir="runs/patchtst_weekly",
    context=104, horizon=13, patch=8, stride=4,
    d_model=128, n_heads=8, n_layers=4, dropout=0.1,
    batch_size=128,          # per GPU
    accum_steps=2,
    base_lr=1e-4,            # tuned for a global batch of 256
    warmup_frac=0.05, epochs=30, n_origins=6,
    grad_ckpt=True, workers=6, seed=0,
)


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def read_weekly(path):
    df = pd.read_csv(path, parse_dates=["week_start"])
    wide = df.pivot(index="series_key", columns="week_start", values="demand").fillna(0.0)
    return wide.to_numpy(np.float32)


class Windows(Dataset):
    def __init__(self, values, mean, std, context, horizon, end):
        self.v, self.mean, self.std = values, mean, std
        self.c, self.h = context, horizon
        last = end - context - horizon
        self.idx = [(s, t) for s in range(values.shape[0]) for t in range(0, last + 1, 2)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        s, t = self.idx[i]
        w = (self.v[s, t:t + self.c + self.h] - self.mean[s]) / self.std[s]
        return torch.from_numpy(w[:self.c]), torch.from_numpy(w[self.c:])


class PatchTST(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.patch, self.stride = cfg.patch, cfg.stride
        n_patches = (cfg.context - cfg.patch) // cfg.stride + 1
        self.embed = nn.Linear(cfg.patch, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, cfg.d_model) * 0.02)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 4 * cfg.d_model,
                                       cfg.dropout, batch_first=True, norm_first=True)
            for _ in range(cfg.n_layers)])
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(n_patches * cfg.d_model, cfg.horizon)
        self.grad_ckpt = cfg.grad_ckpt

    def forward(self, x):
        p = x.unfold(-1, self.patch, self.stride)          # B, N, patch
        h = self.embed(p) + self.pos
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.head(self.norm(h).flatten(1))


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * prog))


@torch.no_grad()
def rolling_origin(model, values, mean, std, cfg, rank, world, device):
    model.eval()
    n, T = values.shape
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    shard = np.arange(rank, n, world)
    for k in range(cfg.n_origins, 0, -1):
        cut = T - k * cfg.horizon
        for b in range(0, len(shard), 4096):
            s = shard[b:b + 4096]
            x = (values[s, cut - cfg.context:cut] - mean[s, None]) / std[s, None]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(torch.from_numpy(x).to(device))
            pred = out.float().cpu().numpy() * std[s, None] + mean[s, None]
            y = values[s, cut:cut + cfg.horizon]
            acc[0] += float(np.abs(np.clip(pred, 0, None) - y).sum())
            acc[1] += float(np.abs(y).sum())
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    values = read_weekly(cfg.data)
    T = values.shape[1]
    train_end = T - cfg.n_origins * cfg.horizon
    mean = values[:, :train_end].mean(1).astype(np.float32)
    std = np.maximum(values[:, :train_end].std(1), 1e-3).astype(np.float32)

    ds = Windows(values, mean, std, cfg.context, cfg.horizon, train_end)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        num_workers=cfg.workers, pin_memory=True, persistent_workers=True)

    global_batch = cfg.batch_size * cfg.accum_steps * world
    lr = cfg.base_lr * global_batch / 256
    updates_per_epoch = math.ceil(len(loader) / cfg.accum_steps)
    total_updates = cfg.epochs * updates_per_epoch
    warmup = max(1, int(cfg.warmup_frac * total_updates))

    model = PatchTST(cfg).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, total_updates))

    start_epoch, best = 0, float("inf")
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
        print(f"global batch {global_batch}, lr {lr:.2e}, {updates_per_epoch} updates/epoch")

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros((), device=device)
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % cfg.accum_steps == 0 or (i + 1) == len(loader)
            ctx = nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.mse_loss(model(x).float(), y)
                (loss / cfg.accum_steps).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        wape = rolling_origin(model.module, values, mean, std, cfg, rank, world, device)

        if rank == 0:
            train_loss = loss_sum.item() / len(loader)
            writer.add_scalar("train/mse", train_loss, epoch)
            writer.add_scalar("backtest/wape", wape, epoch)
            writer.add_scalar("lr", sched.get_last_lr()[0], epoch)
            print(f"[{epoch}] mse {train_loss:.4f} wape {wape:.4f} {time.time() - tic:.0f}s", flush=True)
            best = min(best, wape)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "best": best}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt.tmp"))
            os.replace(os.path.join(cfg.out_dir, "last.pt.tmp"), os.path.join(cfg.out_dir, "last.pt"))
            if wape <= best:
                torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "best_model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
