"""WaveNet-style forecaster for promo-period demand (item x store, daily).

Conditioning: promo depth, display flag, price, day-of-week one-hot.
Validation: hold out the last `val_days` days; metrics are WAPE and bias.

Run:
    torchrun --nproc_per_node=8 09_wavenet_promo.py --config conf/wavenet_promo.json
"""
import argparse
import json
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CFG = {
    "data": "/data/promo/item_store_daily.parquet",
    "out_dir": "runs/wavenet_promo",
    "receptive_days": 128,
    "horizon": 21,
    "val_days": 42,
    "residual_channels": 64,
    "skip_channels": 128,
    "n_layers": 10,
    "batch_size": 256,
    "lr": 2e-4,
    "epochs": 25,
    "workers": 4,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ns = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(json.load(f))
    return cfg


def load_arrays(path):
    t = pq.read_table(path, columns=["series_idx", "day_idx", "units", "promo_depth", "display", "price"])
    d = {c: t.column(c).to_numpy() for c in t.column_names}
    S, T = int(d["series_idx"].max()) + 1, int(d["day_idx"].max()) + 1
    y = np.zeros((S, T), np.float32)
    cov = np.zeros((S, T, 3), np.float32)
    y[d["series_idx"], d["day_idx"]] = d["units"]
    cov[d["series_idx"], d["day_idx"]] = np.stack([d["promo_depth"], d["display"], d["price"]], 1)
    cov[..., 2] = cov[..., 2] / np.maximum(cov[..., 2].max(1, keepdims=True), 1e-3)
    dow = np.eye(7, dtype=np.float32)[np.arange(T) % 7]
    cov = np.concatenate([cov, np.broadcast_to(dow, (S, T, 7))], -1)
    return y, cov


class PromoWindows(Dataset):
    def __init__(self, y, cov, scale, ctx, horizon, starts):
        self.y, self.cov, self.scale = y, cov, scale
        self.ctx, self.h = ctx, horizon
        self.items = [(s, t) for s in range(len(y)) for t in starts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, t = self.items[i]
        L = self.ctx + self.h
        y = self.y[s, t:t + L] / self.scale[s]
        c = self.cov[s, t:t + L]
        return (torch.from_numpy(y[:self.ctx]), torch.from_numpy(c), torch.from_numpy(y[self.ctx:]),
                torch.tensor(self.scale[s]))


class ResidualLayer(nn.Module):
    def __init__(self, rc, sc, cond, dilation):
        super().__init__()
        self.dilation = dilation
        self.conv = nn.Conv1d(rc, 2 * rc, 2, dilation=dilation)
        self.cond = nn.Conv1d(cond, 2 * rc, 1)
        self.res = nn.Conv1d(rc, rc, 1)
        self.skip = nn.Conv1d(rc, sc, 1)

    def forward(self, x, c):
        h = self.conv(F.pad(x, (self.dilation, 0))) + self.cond(c)
        a, b = h.chunk(2, 1)
        h = torch.tanh(a) * torch.sigmoid(b)
        return x + self.res(h), self.skip(h)


class WaveNetForecaster(nn.Module):
    def __init__(self, n_cov, rc, sc, n_layers, horizon):
        super().__init__()
        self.horizon = horizon
        self.inp = nn.Conv1d(1, rc, 1)
        self.layers = nn.ModuleList([ResidualLayer(rc, sc, n_cov, 2 ** (i % 8)) for i in range(n_layers)])
        self.future = nn.Sequential(nn.Linear(horizon * n_cov, sc), nn.ReLU())
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(2 * sc, sc), nn.ReLU(), nn.Linear(sc, horizon))

    def forward(self, y_hist, cov):
        T = y_hist.size(1)
        c_hist = cov[:, :T].transpose(1, 2)
        x = self.inp(y_hist.unsqueeze(1))
        skips = 0
        for layer in self.layers:
            x, s = layer(x, c_hist)
            skips = skips + s
        fut = self.future(cov[:, T:].flatten(1))
        return self.out(torch.cat([skips[..., -1], fut], -1))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    err = act = bias = 0.0
    for y_hist, cov, target, scale in loader:
        y_hist, cov = y_hist.to(device), cov.to(device)
        scale = scale.to(device).unsqueeze(1)
        pred = model(y_hist, cov).clamp_min(0) * scale
        true = target.to(device) * scale
        err += (pred - true).abs().sum().item()
        act += true.sum().item()
        bias += (pred - true).sum().item()
    model.train()
    return {"wape": err / max(act, 1e-6), "bias": bias / max(act, 1e-6)}


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    y, cov = load_arrays(cfg["data"])
    S, T = y.shape
    ctx, H = cfg["receptive_days"], cfg["horizon"]
    split = T - cfg["val_days"]
    scale = np.maximum(y[:, :split].mean(1), 0.5).astype(np.float32)

    train_ds = PromoWindows(y, cov, scale, ctx, H, range(0, split - ctx - H + 1, 3))
    val_ds = PromoWindows(y, cov, scale, ctx, H, range(split - ctx, T - ctx - H + 1, H))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1024, sampler=val_sampler,
                            num_workers=cfg["workers"], pin_memory=True)

    model = WaveNetForecaster(cov.shape[-1], cfg["residual_channels"], cfg["skip_channels"],
                              cfg["n_layers"], H).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.93)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"{S} series x {T} days; train windows {len(train_ds)}, val windows {len(val_ds)}")
    best = float("inf")
    history = []
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for y_hist, c, target, _ in train_loader:
            y_hist, c, target = (t.to(device, non_blocking=True) for t in (y_hist, c, target))
            loss = F.l1_loss(model(y_hist, c), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
        sched.step()

        metrics = validate(model.module, val_loader, device)
        if rank == 0:
            history.append({"epoch": epoch, **metrics, "secs": time.time() - t0})
            print(json.dumps(history[-1]), flush=True)
            if metrics["wape"] < best:
                best = metrics["wape"]
                torch.save({"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch,
                            "metrics": metrics}, os.path.join(cfg["out_dir"], "best.pt"))
            with open(os.path.join(cfg["out_dir"], "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
