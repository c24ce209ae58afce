"""Dilated causal CNN (WaveNet-style gated blocks) for M4 Hourly, 48-step direct forecast.

Writes per-series sMAPE / MASE for the official test horizon to CSV.

    torchrun --nproc_per_node=4 17_wavenet_m4_hourly.py --m4-dir data/m4
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

H, SEASON = 48, 24


class GatedBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.dilation = dilation
        self.filt = nn.Conv1d(ch, ch, 2, dilation=dilation)
        self.gate = nn.Conv1d(ch, ch, 2, dilation=dilation)
        self.res_skip = nn.Conv1d(ch, 2 * ch, 1)

    def forward(self, x):
        h = F.pad(x, (self.dilation, 0))
        z = torch.tanh(self.filt(h)) * torch.sigmoid(self.gate(h))
        res, skip = self.res_skip(z).chunk(2, dim=1)
        return x + res, skip


class WaveNetForecaster(nn.Module):
    def __init__(self, lookback, ch=64, n_layers=8, horizon=H):
        super().__init__()
        self.inp = nn.Conv1d(2, ch, 1)
        self.blocks = nn.ModuleList(GatedBlock(ch, 2 ** (i % 8)) for i in range(n_layers))
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(ch, ch, 1), nn.ReLU())
        self.out = nn.Linear(ch, horizon)

    def forward(self, x, hour):
        h = self.inp(torch.stack([x, hour], 1))
        skips = 0
        for blk in self.blocks:
            h, s = blk(h)
            skips = skips + s
        return self.out(self.head(skips)[:, :, -1])


class HourlyWindows(Dataset):
    def __init__(self, series, lookback, mode, n_per_series=100, seed=0):
        self.series, self.L = series, lookback
        self.items = []
        rng = np.random.default_rng(seed)
        for i, s in enumerate(series):
            if mode == "train":  # forecast origins inside the history, last H kept for validation
                hi = len(s) - 2 * H
                if hi > lookback:
                    self.items += [(i, int(t)) for t in rng.integers(lookback, hi + 1, n_per_series)]
            elif mode == "val":
                self.items.append((i, len(s) - H))
            else:  # test: origin at the end of the history, targets come separately
                self.items.append((i, len(s)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        i, t = self.items[k]
        s = self.series[i]
        x = s[t - self.L:t]
        level = x.mean() + 1e-6
        y = s[t:t + H] if t + H <= len(s) else np.zeros(H, np.float32)
        hour = (np.arange(t - self.L, t) % SEASON) / SEASON
        return (torch.from_numpy(x / level), torch.from_numpy(hour.astype(np.float32)),
                torch.from_numpy(y / level), torch.tensor(level, dtype=torch.float32), i)


def read(path):
    df = pd.read_csv(path).set_index("V1")
    return df.index.tolist(), [r.dropna().to_numpy(np.float32) for _, r in df.iterrows()]


def mase_scale(s):
    return np.abs(s[SEASON:] - s[:-SEASON]).mean()


@torch.no_grad()
def series_metrics(net, loader, device, histories, targets=None):
    net.eval()
    rows = []
    for x, hour, y, level, idx in loader:
        pred = (net(x.to(device), hour.to(device)) * level.to(device)[:, None]).cpu().numpy()
        for j, i in enumerate(idx.tolist()):
            truth = targets[i] if targets is not None else (y[j] * level[j]).numpy()
            p = pred[j]
            smape = 200.0 * np.mean(np.abs(p - truth) / (np.abs(p) + np.abs(truth) + 1e-8))
            hist = histories[i] if targets is not None else histories[i][:-H]
            mase = np.mean(np.abs(p - truth)) / (mase_scale(hist) + 1e-8)
            rows.append((i, smape, mase))
    net.train()
    return pd.DataFrame(rows, columns=["idx", "smape", "mase"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m4-dir", default="data/m4")
    ap.add_argument("--out", default="runs/wavenet_m4_hourly")
    ap.add_argument("--lookback", type=int, default=336)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--batch-size", type=int, default=256, help="global")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ids, train_series = read(os.path.join(args.m4_dir, "Hourly-train.csv"))
    _, test_targets = read(os.path.join(args.m4_dir, "Hourly-test.csv"))
    train_ds = HourlyWindows(train_series, args.lookback, "train")
    val_ds = HourlyWindows(train_series, args.lookback, "val")
    test_ds = HourlyWindows(train_series, args.lookback, "test")

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=DistributedSampler(val_ds, shuffle=False))
    test_loader = DataLoader(test_ds, batch_size=128, sampler=DistributedSampler(test_ds, shuffle=False))

    net = WaveNetForecaster(args.lookback, args.channels, args.layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, hour, y, _, _ in loader:
            x, hour, y = x.to(device), hour.to(device), y.to(device)
            loss = (model(x, hour) - y).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        val = series_metrics(net, val_loader, device, train_series)
        if rank == 0:
            smape = val["smape"].mean()
            print(f"epoch {epoch:02d} loss {loss.item():.4f} val sMAPE {smape:.3f} "
                  f"MASE {val['mase'].mean():.3f}", flush=True)
            if smape < best:
                best = smape
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    test = series_metrics(net, test_loader, device, train_series, test_targets)
    if rank == 0:
        test["series"] = [ids[i] for i in test["idx"]]
        test[["series", "smape", "mase"]].to_csv(os.path.join(args.out, "test_metrics.csv"), index=False)
        print(f"M4 Hourly test: sMAPE {test['smape'].mean():.3f}  MASE {test['mase'].mean():.3f}  "
              f"({len(test)} series)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
