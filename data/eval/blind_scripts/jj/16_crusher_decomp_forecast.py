"""Crusher / conveyor power-draw forecasting for a mine concentrator.

Series decomposition (moving-average trend + seasonal remainder, as in
Autoformer/DLinear) followed by a patch transformer on the seasonal part and a
linear map on the trend.

    torchrun --standalone --nproc_per_node=4 16_crusher_decomp_forecast.py \
        --data-dir /shared/concentrator/power --epochs 40
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--save-dir", default="checkpoints/crusher_decomp")
    ap.add_argument("--seq-len", type=int, default=720)
    ap.add_argument("--pred-len", type=int, default=120)
    ap.add_argument("--kernel", type=int, default=25)
    ap.add_argument("--patch", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class AssetSeries(Dataset):
    """Univariate windows of one asset's power draw (kW), scaled with its train stats."""

    def __init__(self, values, mean, std, seq_len, pred_len, hop):
        self.x = ((values - mean) / std).astype(np.float32)
        self.seq_len, self.pred_len = seq_len, pred_len
        self.starts = np.arange(0, len(self.x) - seq_len - pred_len + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return (torch.from_numpy(self.x[s:s + self.seq_len]),
                torch.from_numpy(self.x[s + self.seq_len:s + self.seq_len + self.pred_len]))


class MovingAvg(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.pool = nn.AvgPool1d(k, stride=1)

    def forward(self, x):  # (B, L)
        front = x[:, :1].repeat(1, (self.k - 1) // 2)
        end = x[:, -1:].repeat(1, self.k // 2)
        return self.pool(torch.cat([front, x, end], 1).unsqueeze(1)).squeeze(1)


class DecompPatchTST(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.patch = a.patch
        n = a.seq_len // a.patch
        self.decomp = MovingAvg(a.kernel)
        self.trend = nn.Linear(a.seq_len, a.pred_len)
        self.embed = nn.Linear(a.patch, a.d_model)
        self.pos = nn.Parameter(torch.zeros(1, n, a.d_model))
        layer = nn.TransformerEncoderLayer(a.d_model, 4, 4 * a.d_model, 0.1, batch_first=True,
                                           norm_first=True)
        self.enc = nn.TransformerEncoder(layer, a.layers, norm=nn.LayerNorm(a.d_model))
        self.season_head = nn.Linear(n * a.d_model, a.pred_len)

    def forward(self, x):
        last = x[:, -1:].detach()
        x = x - last
        trend = self.decomp(x)
        season = x - trend
        tok = self.embed(season.view(x.shape[0], -1, self.patch)) + self.pos
        s_out = self.season_head(self.enc(tok).flatten(1))
        return s_out + self.trend(trend) + last


def build_datasets(a):
    train_parts, val_parts, names = [], [], []
    for path in sorted(glob.glob(os.path.join(a.data_dir, "*.csv"))):
        v = pd.read_csv(path, usecols=["kw"])["kw"].interpolate(limit_direction="both").to_numpy()
        n_tr = int(0.8 * len(v))
        mean, std = v[:n_tr].mean(), v[:n_tr].std() + 1e-6
        train_parts.append(AssetSeries(v[:n_tr], mean, std, a.seq_len, a.pred_len, hop=4))
        val_parts.append(AssetSeries(v[n_tr - a.seq_len:], mean, std, a.seq_len, a.pred_len,
                                     hop=a.pred_len))
        names.append(os.path.basename(path))
    return ConcatDataset(train_parts), ConcatDataset(val_parts), names


@torch.no_grad()
def evaluate(model, loader, device, pred_len):
    model.eval()
    cuts = [c for c in (30, 60, 120) if c <= pred_len]
    acc = torch.zeros(len(cuts) + 2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        e = model(x) - y
        for j, c in enumerate(cuts):
            acc[j] += e[:, :c].abs().mean(1).sum()
        acc[-2] += e.pow(2).mean(1).sum()
        acc[-1] += x.shape[0]
    dist.all_reduce(acc)
    model.train()
    res = {f"mae@{c}": (acc[j] / acc[-1]).item() for j, c in enumerate(cuts)}
    res["mse"] = (acc[-2] / acc[-1]).item()
    return res


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(31)

    train_ds, val_ds, names = build_datasets(a)
    train_loader = DataLoader(train_ds, batch_size=a.batch_size, shuffle=True,
                              num_workers=a.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=a.workers, pin_memory=True)

    model = DDP(DecompPatchTST(a).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    if rank == 0:
        os.makedirs(a.save_dir, exist_ok=True)
        print(f"{len(names)} assets, {len(train_ds)} train windows, {len(val_ds)} val windows")

    best = float("inf")
    for epoch in range(a.epochs):
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running[0] += loss.detach()
            running[1] += 1
        sched.step()
        dist.all_reduce(running)

        res = evaluate(model, val_loader, device, a.pred_len)
        if rank == 0:
            print(f"epoch {epoch:02d} train {(running[0] / running[1]).item():.4f} "
                  + " ".join(f"{k} {v:.4f}" for k, v in res.items())
                  + f" | {time.time() - t0:.0f}s", flush=True)
            if res["mse"] < best:
                best = res["mse"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": res,
                            "assets": names}, os.path.join(a.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
