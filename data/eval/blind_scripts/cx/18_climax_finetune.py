#!/usr/bin/env python3
"""Fine-tune a ClimaX-style model (variable tokenisation + variable aggregation)
for global medium-range forecasting at 5.625 deg (32 x 64), lead time 72 h.

    torchrun --nproc_per_node=8 18_climax_finetune.py --pretrained /mnt/shared/climax/pretrain_5.625.pt
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_VARS = ["land_sea_mask", "orography", "lattitude", "2m_temperature", "10m_u_component_of_wind",
                "10m_v_component_of_wind", "geopotential_500", "temperature_850", "specific_humidity_850",
                "u_component_of_wind_500", "v_component_of_wind_500", "relative_humidity_700"]
OUT_VARS = ["geopotential_500", "temperature_850", "2m_temperature"]


def parse_args():
    p = argparse.ArgumentParser(description="ClimaX global forecasting fine-tune")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--root", default="/mnt/shared/climax/5.625deg_npz")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--out_dir", default="/mnt/shared/climax/runs/finetune_72h")
    p.add_argument("--lead_hours", type=int, default=72)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-7 * 1000)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--warmup_epochs", type=int, default=5)
    p.add_argument("--num_workers", type=int, default=4)
    return p.parse_args()


class NpzForecastDataset(Dataset):
    """Hourly ERA5 stored as one (T, V, 32, 64) array per year."""

    def __init__(self, root, years, lead_hours, variables, out_vars):
        stats = np.load(os.path.join(root, "normalize_stats.npz"))
        self.mean = np.array([stats[f"{v}_mean"] for v in variables], dtype=np.float32)[:, None, None]
        self.std = np.array([stats[f"{v}_std"] for v in variables], dtype=np.float32)[:, None, None]
        self.arrays = [np.load(os.path.join(root, f"{y}.npy"), mmap_mode="r") for y in years]
        self.lengths = [a.shape[0] - lead_hours for a in self.arrays]
        self.offsets = np.cumsum([0] + self.lengths)
        self.lead = lead_hours
        self.out_idx = [variables.index(v) for v in out_vars]

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        y = int(np.searchsorted(self.offsets, i, side="right") - 1)
        t = i - self.offsets[y]
        arr = self.arrays[y]
        x = (np.asarray(arr[t], dtype=np.float32) - self.mean) / self.std
        tgt = (np.asarray(arr[t + self.lead], dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(x), torch.from_numpy(tgt[self.out_idx])


class ClimaXLite(nn.Module):
    def __init__(self, n_vars, n_out, img=(32, 64), patch=2, dim=1024, depth=8, heads=16):
        super().__init__()
        self.p, self.n_out = patch, n_out
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.token_embeds = nn.ModuleList([nn.Conv2d(1, dim, patch, patch) for _ in range(n_vars)])
        self.var_embed = nn.Parameter(torch.zeros(1, n_vars, 1, dim))
        self.var_query = nn.Parameter(torch.zeros(1, 1, dim))
        self.var_agg = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.lead_embed = nn.Linear(1, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, n_out * patch * patch))
        nn.init.trunc_normal_(self.var_embed, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x, lead_days):
        B, V = x.shape[:2]
        toks = torch.stack([emb(x[:, i:i + 1]).flatten(2).transpose(1, 2) for i, emb in enumerate(self.token_embeds)], 1)
        toks = toks + self.var_embed                                    # B, V, L, D
        L, D = toks.shape[2], toks.shape[3]
        toks = toks.permute(0, 2, 1, 3).reshape(B * L, V, D)
        q = self.var_query.expand(B * L, -1, -1)
        agg, _ = self.var_agg(q, toks, toks, need_weights=False)
        h = agg.view(B, L, D) + self.pos_embed + self.lead_embed(lead_days.view(B, 1, 1))
        h = self.norm(self.blocks(h))
        out = self.head(h).view(B, self.gh, self.gw, self.p, self.p, self.n_out)
        return out.permute(0, 5, 1, 3, 2, 4).reshape(B, self.n_out, self.gh * self.p, self.gw * self.p)


def lat_weighted_mse(pred, y, w):
    return ((pred - y) ** 2 * w).mean()


def cosine_warmup(epoch, warmup, total):
    if epoch < warmup:
        return (epoch + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (epoch - warmup) / max(1, total - warmup)))


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_ds = NpzForecastDataset(args.root, range(1979, 2016), args.lead_hours, DEFAULT_VARS, OUT_VARS)
    val_ds = NpzForecastDataset(args.root, [2017], args.lead_hours, DEFAULT_VARS, OUT_VARS)
    val_ds = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), 12 * world)))
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.num_workers)

    lat = np.linspace(-87.1875, 87.1875, 32)
    w = np.cos(np.deg2rad(lat))
    w = torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)
    lead_days = args.lead_hours / 24.0

    model = ClimaXLite(len(DEFAULT_VARS), len(OUT_VARS))
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        sd = {k: v for k, v in sd["state_dict"].items() if not k.startswith("head.")}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded pretrained weights; missing={missing} unexpected={unexpected}")
    model = DDP(model.to(device), device_ids=[args.local_rank], output_device=args.local_rank)

    decay, no_decay = [], []
    for n, p_ in model.named_parameters():
        (no_decay if p_.ndim < 2 or "embed" in n or "query" in n else decay).append(p_)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 1e-5}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: cosine_warmup(e, args.warmup_epochs, args.epochs))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lead = torch.full((x.shape[0],), lead_days, device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, lead)
            loss = lat_weighted_mse(pred.float(), y, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_dl)}] loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        acc = torch.zeros(len(OUT_VARS) + 1, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                lead = torch.full((x.shape[0],), lead_days, device=device)
                pred = model.module(x, lead)
                acc[:-1] += ((pred - y) ** 2 * w).mean(dim=(-2, -1)).sum(0).double()
                acc[-1] += x.shape[0]
        dist.all_reduce(acc)
        rmse = torch.sqrt(acc[:-1] / acc[-1]).tolist()
        if rank == 0:
            print(f"epoch {epoch} done ({time.time() - tic:.0f}s) val rmse(norm) " +
                  ", ".join(f"{v}={r:.4f}" for v, r in zip(OUT_VARS, rmse)), flush=True)
            ckpt = {"state_dict": model.module.state_dict(), "epoch": epoch, "optimizer": opt.state_dict()}
            torch.save(ckpt, os.path.join(args.out_dir, "last.ckpt"))
            if sum(rmse) < best:
                best = sum(rmse)
                torch.save(ckpt, os.path.join(args.out_dir, "best.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
