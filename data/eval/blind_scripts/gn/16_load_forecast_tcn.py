"""Electricity-load forecasting (96-step horizon) with a temporal conv net, DDP.

Sliding windows over a multivariate series; validation MSE/MAE on the next
chronological block every epoch, ReduceLROnPlateau + early stopping, the best
model is evaluated on the final test block.

    torchrun --nproc_per_node=4 16_load_forecast_tcn.py --csv data/electricity.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class Windows(Dataset):
    def __init__(self, values, lookback, horizon):
        self.v = torch.from_numpy(values.astype(np.float32))
        self.lookback, self.horizon = lookback, horizon

    def __len__(self):
        return len(self.v) - self.lookback - self.horizon + 1

    def __getitem__(self, i):
        x = self.v[i: i + self.lookback]
        y = self.v[i + self.lookback: i + self.lookback + self.horizon]
        return x, y


class TemporalBlock(nn.Module):
    def __init__(self, cin, cout, dilation, k=3, dropout=0.1):
        super().__init__()
        pad = (k - 1) * dilation
        self.net = nn.Sequential(
            weight_norm(nn.Conv1d(cin, cout, k, padding=pad, dilation=dilation)), nn.ReLU(), nn.Dropout(dropout),
            weight_norm(nn.Conv1d(cout, cout, k, padding=pad, dilation=dilation)), nn.ReLU(), nn.Dropout(dropout),
        )
        self.pad = pad
        self.down = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        out = x
        for layer in self.net:
            out = layer(out)
            if isinstance(layer, nn.Conv1d):
                out = out[..., : -self.pad]  # causal: chop the right padding
        return torch.relu(out + self.down(x))


class TCNForecaster(nn.Module):
    def __init__(self, n_series, lookback, horizon, channels=(128, 128, 128, 128, 128)):
        super().__init__()
        layers, cin = [], n_series
        for i, c in enumerate(channels):
            layers.append(TemporalBlock(cin, c, dilation=2 ** i))
            cin = c
        self.tcn = nn.Sequential(*layers)
        self.head = nn.Linear(cin, horizon * n_series)
        self.n_series, self.horizon = n_series, horizon

    def forward(self, x):  # x: (B, L, N)
        h = self.tcn(x.transpose(1, 2))[..., -1]
        return self.head(h).view(-1, self.horizon, self.n_series)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x)
        acc[0] += ((pred - y) ** 2).sum().double()
        acc[1] += (pred - y).abs().sum().double()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True)
    parser.add_argument("--out", default="checkpoints/tcn_electricity")
    parser.add_argument("--lookback", type=int, default=336)
    parser.add_argument("--horizon", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--patience", type=int, default=10)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    df = pd.read_csv(args.csv, index_col=0, parse_dates=True)
    values = df.values.astype(np.float64)
    n = len(values)
    n_train, n_val = int(0.7 * n), int(0.1 * n)
    mean, std = values[:n_train].mean(0), values[:n_train].std(0) + 1e-8
    values = (values - mean) / std
    train_ds = Windows(values[:n_train], args.lookback, args.horizon)
    val_ds = Windows(values[n_train - args.lookback: n_train + n_val], args.lookback, args.horizon)
    test_ds = Windows(values[n_train + n_val - args.lookback:], args.lookback, args.horizon)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=256)

    model = TCNForecaster(values.shape[1], args.lookback, args.horizon).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=3)
    loss_fn = nn.MSELoss()

    os.makedirs(args.out, exist_ok=True)
    ckpt_file = os.path.join(args.out, "best.pt")
    best_mse, wait = float("inf"), 0
    for epoch in range(args.epochs):
        t0 = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            epoch_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(epoch_loss)

        val_mse, val_mae = evaluate(model.module, val_loader, device)
        plateau.step(val_mse)
        if rank == 0:
            print(f"epoch {epoch:3d} train {epoch_loss[0].item() / epoch_loss[1].item():.4f} "
                  f"val mse {val_mse:.4f} mae {val_mae:.4f} lr {optimizer.param_groups[0]['lr']:.1e} "
                  f"{time.time() - t0:.1f}s", flush=True)

        if val_mse < best_mse:
            best_mse, wait = val_mse, 0
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_mse": val_mse,
                            "mean": mean, "std": std}, ckpt_file)
        else:
            wait += 1
            if wait > args.patience:
                if rank == 0:
                    print(f"early stopping at epoch {epoch}", flush=True)
                break

    dist.barrier()
    best = torch.load(ckpt_file, map_location=device, weights_only=False)
    model.module.load_state_dict(best["model"])
    test_mse, test_mae = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"best epoch {best['epoch']}: val mse {best['val_mse']:.4f} | test mse {test_mse:.4f} "
              f"mae {test_mae:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
