"""Reactor temperature/pressure forecasting with a patch transformer trained on a
short horizon and evaluated with autoregressive rollout to longer horizons.

Run:  torchrun --standalone --nproc_per_node=4 06_reactor_rollout_forecast.py --config reactor.json
"""
import argparse
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "csv": "/data/plant/reactor_r2_1min.csv",
    "out_dir": "outputs/reactor_rollout",
    "lookback": 240,
    "step_horizon": 30,
    "eval_horizons": [30, 60, 180, 360],
    "patch": 12,
    "d_model": 128,
    "n_heads": 8,
    "n_layers": 3,
    "dropout": 0.1,
    "batch_size": 128,
    "epochs": 40,
    "lr": 5e-4,
    "num_workers": 4,
    "seed": 11,
}


class RevIN(nn.Module):
    def __init__(self, n_ch, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(n_ch))
        self.b = nn.Parameter(torch.zeros(n_ch))

    def norm(self, x):  # (B, L, C)
        self.mu = x.mean(1, keepdim=True).detach()
        self.sd = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + self.eps).detach()
        return (x - self.mu) / self.sd * self.w + self.b

    def denorm(self, y):
        return (y - self.b) / (self.w + self.eps * self.eps) * self.sd + self.mu


class ReactorForecaster(nn.Module):
    def __init__(self, n_ch, cfg):
        super().__init__()
        self.lookback, self.horizon, self.patch = cfg.lookback, cfg.step_horizon, cfg.patch
        n_tok = cfg.lookback // cfg.patch
        self.revin = RevIN(n_ch)
        self.embed = nn.Linear(cfg.patch, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(1, n_tok, cfg.d_model))
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, 2 * cfg.d_model, cfg.dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers)
        self.head = nn.Sequential(nn.Flatten(1), nn.Dropout(cfg.dropout),
                                  nn.Linear(n_tok * cfg.d_model, cfg.step_horizon))

    def forward(self, x):  # (B, L, C) -> (B, H, C)
        B, L, C = x.shape
        z = self.revin.norm(x)
        z = z.permute(0, 2, 1).reshape(B * C, L)  # channel independence
        tok = self.embed(z.unfold(-1, self.patch, self.patch)) + self.pos
        out = self.head(self.encoder(tok)).reshape(B, C, self.horizon).permute(0, 2, 1)
        return self.revin.denorm(out)

    @torch.no_grad()
    def rollout(self, x, total):
        """Feed predictions back in until `total` steps are produced."""
        preds = []
        ctx = x
        while sum(p.shape[1] for p in preds) < total:
            y = self.forward(ctx)
            preds.append(y)
            ctx = torch.cat([ctx, y], dim=1)[:, -self.lookback:]
        return torch.cat(preds, dim=1)[:, :total]


class SlidingWindows(Dataset):
    def __init__(self, arr, lookback, horizon, stride=1):
        self.arr, self.lookback, self.horizon = arr, lookback, horizon
        self.starts = np.arange(0, len(arr) - lookback - horizon + 1, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.arr[s:s + self.lookback]
        y = self.arr[s + self.lookback:s + self.lookback + self.horizon]
        return torch.from_numpy(x), torch.from_numpy(y)


def multi_horizon_eval(model, loader, horizons, device):
    model.eval()
    H = max(horizons)
    sums = torch.zeros(len(horizons), 2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model.rollout(x, H)
        for k, h in enumerate(horizons):
            sums[k, 0] += (pred[:, :h] - y[:, :h]).abs().sum()
            sums[k, 1] += y[:, :h].numel()
    dist.all_reduce(sums)
    model.train()
    return {f"mae@{h}": (sums[k, 0] / sums[k, 1]).item() for k, h in enumerate(horizons)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    cfg = SimpleNamespace(**cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)

    df = pd.read_csv(cfg.csv, parse_dates=["ts"]).set_index("ts").sort_index()
    df = df.resample("1min").mean().interpolate(limit=10).dropna()
    values = df.to_numpy(np.float32)
    n = len(values)
    tr_end, va_end = int(0.7 * n), int(0.85 * n)
    mu, sd = values[:tr_end].mean(0), values[:tr_end].std(0) + 1e-6  # per-sensor
    values = (values - mu) / sd
    H = max(cfg.eval_horizons)
    train_ds = SlidingWindows(values[:tr_end], cfg.lookback, cfg.step_horizon)
    val_ds = SlidingWindows(values[tr_end - cfg.lookback:va_end], cfg.lookback, H, stride=5)

    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, cfg.batch_size, sampler=tr_sampler, drop_last=True,
                          num_workers=cfg.num_workers, pin_memory=True)
    val_dl = DataLoader(val_ds, cfg.batch_size, sampler=va_sampler,
                        num_workers=cfg.num_workers, pin_memory=True)

    net = ReactorForecaster(values.shape[1], cfg).to(dev)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=3)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"sensors={values.shape[1]} train={len(train_ds)} val={len(val_ds)}")

    best = float("inf")
    for epoch in range(cfg.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=dev)
        for x, y in train_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(tot)

        metrics = multi_horizon_eval(model, val_dl, cfg.eval_horizons, dev)
        score = float(np.mean(list(metrics.values())))
        sched.step(score)
        if rank == 0:
            print(f"ep {epoch:02d} train {tot[0].item() / tot[1].item():.4f} "
                  + " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            if score < best:
                best = score
                torch.save({"model": net.state_dict(), "mu": torch.from_numpy(mu),
                            "sd": torch.from_numpy(sd), "epoch": epoch, "metrics": metrics},
                           os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
