"""GRU forecaster for the UCI individual household electric power consumption data.

Minute readings are resampled to hourly means; the model sees one week of all
seven measurements plus calendar features and predicts the next 24 hours of
global active power. Metrics go to Weights & Biases.

    torchrun --nproc_per_node=4 19_gru_household_power.py --txt data/household_power_consumption.txt
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--txt", default="data/household_power_consumption.txt")
    p.add_argument("--out", default="runs/gru_household")
    p.add_argument("--wandb-project", default="household-power")
    p.add_argument("--run-name", default=None)
    p.add_argument("--lookback", type=int, default=168)
    p.add_argument("--horizon", type=int, default=24)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=6)
    return p.parse_args()


def load_hourly(path):
    df = pd.read_csv(path, sep=";", na_values="?", low_memory=False)
    df["dt"] = pd.to_datetime(df["Date"] + " " + df["Time"], format="%d/%m/%Y %H:%M:%S")
    df = df.drop(columns=["Date", "Time"]).set_index("dt").astype(np.float32)
    hourly = df.resample("h").mean()
    # short outages: interpolate; the model input also gets a "was missing" flag
    missing = hourly.isna().any(axis=1).to_numpy(np.float32)
    hourly = hourly.interpolate(limit_direction="both")
    idx = hourly.index
    cal = np.stack([np.sin(2 * np.pi * idx.hour / 24), np.cos(2 * np.pi * idx.hour / 24),
                    np.sin(2 * np.pi * idx.dayofweek / 7), np.cos(2 * np.pi * idx.dayofweek / 7),
                    np.sin(2 * np.pi * idx.dayofyear / 365.25), np.cos(2 * np.pi * idx.dayofyear / 365.25)],
                   1).astype(np.float32)
    return hourly.to_numpy(np.float32), cal, missing, list(hourly.columns)


class PowerWindows(Dataset):
    def __init__(self, feats, target, lo, hi, lookback, horizon, stride=1):
        self.feats, self.target = feats, target
        self.L, self.H = lookback, horizon
        self.starts = np.arange(lo, hi - lookback - horizon + 1, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return (torch.from_numpy(self.feats[s:s + self.L]),
                torch.from_numpy(self.target[s + self.L:s + self.L + self.H]))


class GRUForecaster(nn.Module):
    def __init__(self, n_in, hidden, layers, dropout, horizon):
        super().__init__()
        self.gru = nn.GRU(n_in, hidden, layers, batch_first=True, dropout=dropout)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, horizon))

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


@torch.no_grad()
def evaluate(net, loader, device, scale):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        d = (net(x) - y) * scale
        s += torch.stack([(d ** 2).sum().double(), d.abs().sum().double(),
                          torch.tensor(float(d.numel()), device=device, dtype=torch.float64)])
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).sqrt().item(), (s[1] / s[2]).item()


def main():
    args = parse_args()
    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    values, cal, missing, cols = load_hourly(args.txt)
    T = len(values)
    n_train, n_val = int(T * 0.7), int(T * 0.15)
    mu, sd = values[:n_train].mean(0), values[:n_train].std(0) + 1e-6
    z = (values - mu) / sd
    feats = np.concatenate([z, cal, missing[:, None]], 1).astype(np.float32)
    tcol = cols.index("Global_active_power")
    target = np.ascontiguousarray(z[:, tcol])

    train_ds = PowerWindows(feats, target, 0, n_train, args.lookback, args.horizon)
    val_ds = PowerWindows(feats, target, n_train - args.lookback, n_train + n_val, args.lookback,
                          args.horizon, stride=args.horizon)
    test_ds = PowerWindows(feats, target, n_train + n_val - args.lookback, T, args.lookback,
                           args.horizon, stride=args.horizon)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=512)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=512)

    net = GRUForecaster(feats.shape[1], args.hidden, args.layers, args.dropout, args.horizon).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader))
    kw = float(sd[tcol])
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "best.pt")

    best, bad, step = float("inf"), 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                run.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step=step)

        val_rmse, val_mae = evaluate(net, val_loader, device, kw)
        if rank == 0:
            run.log({"val/rmse_kw": val_rmse, "val/mae_kw": val_mae, "epoch": epoch,
                     "epoch_time_s": time.time() - t0}, step=step)
            print(f"epoch {epoch} val rmse {val_rmse:.4f} kW mae {val_mae:.4f} kW", flush=True)
        if val_rmse < best:
            best, bad = val_rmse, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "mu": mu, "sd": sd, "cols": cols}, ckpt)
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.barrier()
    net.load_state_dict(torch.load(ckpt, map_location=device, weights_only=False)["model"])
    test_rmse, test_mae = evaluate(net, test_loader, device, kw)
    if rank == 0:
        run.summary.update({"test/rmse_kw": test_rmse, "test/mae_kw": test_mae, "best_val_rmse": best})
        print(f"test rmse {test_rmse:.4f} kW, mae {test_mae:.4f} kW")
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
