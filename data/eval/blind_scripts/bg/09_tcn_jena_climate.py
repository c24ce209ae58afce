"""Temporal convolutional network for the Jena climate record (14 sensors, 10-min steps).

Predicts the next 24 hours of air temperature (144 steps, hourly-averaged to 24
outputs) from the last 5 days of all sensors.

    torchrun --nproc_per_node=4 09_tcn_jena_climate.py --csv data/jena_climate_2009_2016.csv
"""
import argparse
import json
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--csv", default="data/jena_climate_2009_2016.csv")
    p.add_argument("--out", default="runs/tcn_jena")
    p.add_argument("--lookback", type=int, default=720)
    p.add_argument("--horizon-hours", type=int, default=24)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--levels", type=int, default=8)
    p.add_argument("--kernel", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--bf16", action="store_true")
    return p


class Chomp(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x[..., :-self.n] if self.n else x


class TemporalBlock(nn.Module):
    def __init__(self, c_in, c_out, kernel, dilation, dropout):
        super().__init__()
        pad = (kernel - 1) * dilation
        self.net = nn.Sequential(
            weight_norm(nn.Conv1d(c_in, c_out, kernel, padding=pad, dilation=dilation)), Chomp(pad),
            nn.ReLU(), nn.Dropout(dropout),
            weight_norm(nn.Conv1d(c_out, c_out, kernel, padding=pad, dilation=dilation)), Chomp(pad),
            nn.ReLU(), nn.Dropout(dropout))
        self.down = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x):
        return F.relu(self.net(x) + self.down(x))


class TCNForecaster(nn.Module):
    def __init__(self, n_in, channels, levels, kernel, dropout, horizon):
        super().__init__()
        blocks, c = [], n_in
        for i in range(levels):
            blocks.append(TemporalBlock(c, channels, kernel, 2 ** i, dropout))
            c = channels
        self.tcn = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, horizon)

    def forward(self, x):
        # x: (B, L, F) -> conv over time
        h = self.tcn(x.transpose(1, 2))
        return self.head(h[:, :, -1])


class ClimateWindows(Dataset):
    def __init__(self, feats, temp_hourly_target, start, end, lookback, horizon_steps, stride):
        self.feats = feats
        self.target = temp_hourly_target
        self.lookback, self.h = lookback, horizon_steps
        self.starts = np.arange(start, end - lookback - horizon_steps + 1, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        t = self.starts[i]
        x = self.feats[t:t + self.lookback]
        y = self.target[t + self.lookback:t + self.lookback + self.h].reshape(-1, 6).mean(1)
        return torch.from_numpy(x), torch.from_numpy(y)


def prepare(csv_path):
    df = pd.read_csv(csv_path)
    df = df.drop(columns=["Date Time"])
    # sensor glitches: -9999 wind speeds
    for col in ("wv (m/s)", "max. wv (m/s)"):
        df.loc[df[col] < 0, col] = 0.0
    wd = np.deg2rad(df.pop("wd (deg)"))
    df["wx"] = df["wv (m/s)"] * np.cos(wd)
    df["wy"] = df["wv (m/s)"] * np.sin(wd)
    values = df.to_numpy(np.float32)
    temp_col = list(df.columns).index("T (degC)")
    return values, temp_col


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    values, temp_col = prepare(args.csv)
    n = len(values)
    n_train, n_val = int(0.7 * n), int(0.2 * n)
    mean = values[:n_train].mean(0)
    std = values[:n_train].std(0) + 1e-6
    feats = ((values - mean) / std).astype(np.float32)
    target = np.ascontiguousarray(feats[:, temp_col])

    horizon_steps = args.horizon_hours * 6
    train_ds = ClimateWindows(feats, target, 0, n_train, args.lookback, horizon_steps, stride=6)
    val_ds = ClimateWindows(feats, target, n_train - args.lookback, n_train + n_val, args.lookback,
                            horizon_steps, stride=36)

    per_gpu = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=512, num_workers=2)

    net = TCNForecaster(feats.shape[1], args.channels, args.levels, args.kernel, args.dropout,
                        args.horizon_hours).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    amp_dtype = torch.bfloat16 if args.bf16 else torch.float32

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        json.dump({"mean": mean.tolist(), "std": std.tolist(), "temp_col": temp_col, **vars(args)},
                  open(os.path.join(args.out, "meta.json"), "w"), indent=1)
    logger.info("train %d windows (%d per rank per epoch), val %d", len(train_ds), len(train_sampler), len(val_ds))

    best, bad = float("inf"), 0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=args.bf16):
                pred = model(x)
            loss = F.mse_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])

        net.eval()
        err = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                pred = net(x)
                err += torch.stack([((pred - y) ** 2).sum(), (pred - y).abs().sum(),
                                    torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(running)
        dist.all_reduce(err)
        val_mse = (err[0] / err[2]).item()
        val_mae_degc = (err[1] / err[2]).item() * std[temp_col]
        logger.info("epoch %d train_mse %.4f val_mse %.4f val_mae %.3f degC", epoch,
                    (running[0] / running[1]).item(), val_mse, val_mae_degc)

        if val_mse < best:
            best, bad = val_mse, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_mse": val_mse},
                           os.path.join(args.out, "best.pt"))
        else:
            bad += 1
            if bad >= args.patience:
                logger.info("early stop at epoch %d", epoch)
                break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
