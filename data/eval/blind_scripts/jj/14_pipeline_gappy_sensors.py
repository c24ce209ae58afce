"""Pipeline pressure/flow forecasting from gappy SCADA sensors.

Remote RTUs drop out regularly, so windows carry an observation mask; missing
inputs are zero-filled (after scaling) and the loss only counts observed targets.

    torchrun --standalone --nproc_per_node=4 14_pipeline_gappy_sensors.py \
        --zarr /shared/pipeline/scada.zarr --out runs/pipeline_gappy
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--out", default="runs/pipeline_gappy")
    ap.add_argument("--lookback", type=int, default=288)
    ap.add_argument("--horizon", type=int, default=48)
    ap.add_argument("--patch", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-observed", type=float, default=0.6,
                    help="minimum fraction of observed target values in a batch")
    return ap.parse_args()


class GappyWindows(Dataset):
    def __init__(self, values, observed, lookback, horizon, hop):
        self.v, self.m = values, observed  # (T, C) float32 (NaN->0), (T, C) bool
        self.lb, self.h = lookback, horizon
        self.starts = np.arange(0, len(values) - lookback - horizon + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        e = s + self.lb
        return (torch.from_numpy(self.v[s:e]), torch.from_numpy(self.m[s:e]),
                torch.from_numpy(self.v[e:e + self.h]), torch.from_numpy(self.m[e:e + self.h]))


class MaskedPatchTST(nn.Module):
    def __init__(self, n_ch, a):
        super().__init__()
        self.patch, self.h, self.n_ch = a.patch, a.horizon, n_ch
        n = a.lookback // a.patch
        # value patch and mask patch are embedded together
        self.embed = nn.Linear(2 * a.patch, a.d_model)
        self.pos = nn.Parameter(torch.zeros(1, n, a.d_model))
        enc = nn.TransformerEncoderLayer(a.d_model, 8, 4 * a.d_model, 0.1, batch_first=True,
                                         norm_first=True)
        self.enc = nn.TransformerEncoder(enc, a.layers, norm=nn.LayerNorm(a.d_model))
        self.head = nn.Linear(n * a.d_model, a.horizon)

    def forward(self, x, m):  # (B, L, C), (B, L, C)
        B, L, C = x.shape
        mf = m.float()
        cnt = mf.sum(1, keepdim=True).clamp_min(1)
        mu = (x * mf).sum(1, keepdim=True) / cnt
        sd = (((x - mu) * mf) ** 2).sum(1, keepdim=True).div(cnt).add(1e-5).sqrt()
        z = ((x - mu) / sd) * mf
        z = torch.stack([z, mf], -1).permute(0, 2, 1, 3).reshape(B * C, L // self.patch, 2 * self.patch)
        h = self.enc(self.embed(z) + self.pos)
        y = self.head(h.flatten(1)).view(B, C, self.h).transpose(1, 2)
        return y * sd + mu


def masked_mse(pred, target, mask):
    mf = mask.float()
    return ((pred - target) ** 2 * mf).sum() / mf.sum().clamp_min(1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, m, y, my in loader:
        x, m, y, my = (t.to(device, non_blocking=True) for t in (x, m, y, my))
        p = model(x, m)
        mf = my.float()
        acc[0] += ((p - y) ** 2 * mf).sum()
        acc[1] += ((p - y).abs() * mf).sum()
        acc[2] += mf.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def load_arrays(path):
    root = zarr.open(path, mode="r")
    raw = root["values"][:].astype(np.float32)  # (T, C) with NaN gaps
    observed = ~np.isnan(raw)
    n_tr = int(0.75 * len(raw))
    mean = np.nanmean(raw[:n_tr], axis=0)
    std = np.nanstd(raw[:n_tr], axis=0) + 1e-6
    scaled = np.nan_to_num((raw - mean) / std, nan=0.0).astype(np.float32)
    return scaled, observed, n_tr, mean, std


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    vals, obs, n_tr, mean, std = load_arrays(a.zarr)
    train_ds = GappyWindows(vals[:n_tr], obs[:n_tr], a.lookback, a.horizon, hop=2)
    val_ds = GappyWindows(vals[n_tr - a.lookback:], obs[n_tr - a.lookback:], a.lookback, a.horizon,
                          hop=a.horizon)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=2 * a.batch, sampler=val_sampler, num_workers=6,
                        pin_memory=True)

    model = DDP(MaskedPatchTST(vals.shape[1], a).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs)

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"sensors={vals.shape[1]} observed={obs.mean():.1%} train={len(train_ds)}")

    best = float("inf")
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, m, y, my in train_dl:
            if my.float().mean() < a.min_observed:
                stats[2] += 1
                continue
            x, m, y, my = (t.to(device, non_blocking=True) for t in (x, m, y, my))
            loss = masked_mse(model(x, m), y, my)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats[0] += loss.detach()
            stats[1] += 1
        sched.step()
        dist.all_reduce(stats)

        val_mse, val_mae = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} train {(stats[0] / stats[1].clamp_min(1)).item():.4f} "
                  f"skipped {int(stats[2].item())} val mse {val_mse:.4f} mae {val_mae:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_mse < best:
                best = val_mse
                torch.save({"model": model.module.state_dict(), "mean": torch.from_numpy(mean),
                            "std": torch.from_numpy(std), "epoch": epoch},
                           os.path.join(a.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
