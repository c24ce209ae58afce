"""ClimateBench CNN-LSTM emulator: emission pathways -> annual-mean surface temperature.

Inputs per year: global CO2 / CH4 (scalars, broadcast), SO2 and BC emission maps (96x144);
a 10-year window of inputs predicts the temperature map of the last year. Training
scenarios: historical, ssp126, ssp370, ssp585, hist-GHG, hist-aer; test: ssp245.

    torchrun --nproc_per_node=4 18_climatebench_cnn_lstm.py --data-dir /data/climatebench/train_val \
        --test-dir /data/climatebench/test --out runs/cnn_lstm_tas
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TRAIN_SCEN = ["historical", "ssp126", "ssp370", "ssp585", "hist-GHG", "hist-aer"]
SLIDER = 10


def parse_args():
    parser = argparse.ArgumentParser(description="ClimateBench CNN-LSTM (PyTorch DDP)")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--test-dir", required=True)
    parser.add_argument("--out", default="runs/cnn_lstm_tas")
    parser.add_argument("--target", default="tas")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--members", type=int, default=3, help="ensemble members averaged for targets")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def load_inputs(path):
    ds = xr.open_dataset(path)
    co2 = ds["CO2"].values[:, None, None] * np.ones((1, 96, 144))
    ch4 = ds["CH4"].values[:, None, None] * np.ones((1, 96, 144))
    x = np.stack([co2, ch4, ds["SO2"].values, ds["BC"].values], axis=1)  # (years, 4, 96, 144)
    return x.astype(np.float32)


def load_target(path, var, members):
    ds = xr.open_dataset(path)
    return ds[var].isel(member=slice(0, members)).mean("member").values.astype(np.float32)  # (years, 96, 144)


def windows(x, y=None):
    xs = np.stack([x[i:i + SLIDER] for i in range(len(x) - SLIDER + 1)])
    ys = None if y is None else y[SLIDER - 1:]
    return xs, ys


def build_training_set(data_dir, var, members):
    xs, ys = [], []
    for scen in TRAIN_SCEN:
        x = load_inputs(os.path.join(data_dir, f"inputs_{scen}.nc"))
        y = load_target(os.path.join(data_dir, f"outputs_{scen}.nc"), var, members)
        if scen.startswith("ssp"):
            # prepend the end of the historical period so that 2015-2023 have full windows
            xh = load_inputs(os.path.join(data_dir, "inputs_historical.nc"))[-(SLIDER - 1):]
            yh = load_target(os.path.join(data_dir, "outputs_historical.nc"), var, members)[-(SLIDER - 1):]
            x, y = np.concatenate([xh, x]), np.concatenate([yh, y])
        wx, wy = windows(x, y)
        xs.append(wx)
        ys.append(wy)
    return np.concatenate(xs), np.concatenate(ys)


class CNNLSTM(nn.Module):
    def __init__(self, in_ch=4, hidden=25):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(in_ch, 20, 3, padding=1), nn.ReLU(),
            nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.lstm = nn.LSTM(20, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, 96 * 144)

    def forward(self, x):
        B, T = x.shape[:2]
        feats = self.encoder(x.flatten(0, 1)).view(B, T, -1)
        h, _ = self.lstm(feats)
        return self.decoder(h[:, -1]).view(B, 96, 144)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)

    x_tr, y_tr = build_training_set(args.data_dir, args.target, args.members)
    # normalise inputs per channel with training statistics
    mean = x_tr.mean(axis=(0, 1, 3, 4), keepdims=True)[0]
    std = x_tr.std(axis=(0, 1, 3, 4), keepdims=True)[0] + 1e-8
    x_tr = (x_tr - mean) / std
    train_set = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=2)

    x_te = load_inputs(os.path.join(args.test_dir, "inputs_ssp245.nc"))
    y_te = load_target(os.path.join(args.test_dir, "outputs_ssp245.nc"), args.target, args.members)
    xh = load_inputs(os.path.join(args.data_dir, "inputs_historical.nc"))[-(SLIDER - 1):]
    x_te, _ = windows(np.concatenate([xh, x_te]))
    x_te = torch.from_numpy((x_te - mean) / std)
    y_te = torch.from_numpy(y_te)
    lat = np.deg2rad(xr.open_dataset(os.path.join(args.test_dir, "outputs_ssp245.nc"))["lat"].values)
    w_lat = torch.tensor(np.cos(lat) / np.cos(lat).mean(), dtype=torch.float32, device=device).view(1, -1, 1)

    model = DDP(CNNLSTM().to(device), device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    loss_fn = nn.MSELoss()
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * xb.shape[0], torch.tensor(float(xb.shape[0]), device=device)])
        scheduler.step()
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch:3d} | {time.time() - t0:.1f}s | train mse {(total[0] / total[1]).item():.4f}",
                  flush=True)

    # ssp245 evaluation (ClimateBench NRMSE, 2080-2100), small enough for one GPU
    if rank == 0:
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model.module(xb.to(device)) for xb in x_te.split(32)])
        truth = y_te.to(device)
        sel = slice(-21, None)
        p, t = pred[sel], truth[sel]
        norm = (w_lat * t).mean(dim=(1, 2)).abs().mean()
        spatial = torch.sqrt((w_lat * (p.mean(0) - t.mean(0)) ** 2).mean()) / norm
        glob_ = torch.sqrt((((w_lat * p).mean(dim=(1, 2)) - (w_lat * t).mean(dim=(1, 2))) ** 2).mean()) / norm
        print(f"ssp245 2080-2100 NRMSE_s {spatial.item():.3f} NRMSE_g {glob_.item():.3f} "
              f"total {(spatial + 5 * glob_).item():.3f}")
        torch.save({"model": model.module.state_dict(), "mean": mean, "std": std, "args": vars(args)},
                   os.path.join(args.out, "cnn_lstm.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
