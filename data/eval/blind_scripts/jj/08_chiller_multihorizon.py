"""Chiller-plant load & temperature forecasting (PatchTST, channel independent).

Reports MAE / RMSE / sMAPE per horizon bucket (15 min .. 24 h) on the validation
span and keeps the checkpoint with the best mean MAE.

  torchrun --standalone --nproc_per_node=8 08_chiller_multihorizon.py --data /mnt/fs/chiller/plant3.h5
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

HORIZON_BUCKETS = {"15m": 1, "1h": 4, "6h": 24, "24h": 96}  # 15-min resolution


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="exp/chiller_patchtst")
    p.add_argument("--lookback", type=int, default=672)  # one week
    p.add_argument("--horizon", type=int, default=96)
    p.add_argument("--patch", type=int, default=24)
    p.add_argument("--stride", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class PlantWindows(Dataset):
    """(sensor, start) windows over a (T, C) array normalised per sensor."""

    def __init__(self, arr, lookback, horizon, step=1):
        self.arr = arr
        self.lb, self.h = lookback, horizon
        self.n_start = (arr.shape[0] - lookback - horizon) // step + 1
        self.step = step

    def __len__(self):
        return self.n_start * self.arr.shape[1]

    def __getitem__(self, i):
        c, k = divmod(i, self.n_start)
        s = k * self.step
        seg = self.arr[s:s + self.lb + self.h, c]
        return torch.from_numpy(seg[: self.lb]), torch.from_numpy(seg[self.lb:])


class PatchTST(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.patch, self.stride = a.patch, a.stride
        n = (a.lookback - a.patch) // a.stride + 1
        self.w_p = nn.Linear(a.patch, a.dim)
        self.w_pos = nn.Parameter(torch.empty(n, a.dim).uniform_(-0.02, 0.02))
        enc = nn.TransformerEncoderLayer(a.dim, a.heads, 2 * a.dim, a.dropout, batch_first=True,
                                         norm_first=False)
        self.encoder = nn.TransformerEncoder(enc, a.layers, norm=nn.LayerNorm(a.dim))
        self.head = nn.Sequential(nn.Flatten(-2), nn.Linear(n * a.dim, a.horizon))

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        s = (x.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt()
        z = ((x - m) / s).unfold(-1, self.patch, self.stride)
        z = self.encoder(self.w_p(z) + self.w_pos)
        return self.head(z) * s + m


def horizon_metrics(pred, true):
    out = {}
    for name, h in HORIZON_BUCKETS.items():
        p, t = pred[:, :h], true[:, :h]
        out[f"mae_{name}"] = float(np.abs(p - t).mean())
        out[f"rmse_{name}"] = float(np.sqrt(((p - t) ** 2).mean()))
        out[f"smape_{name}"] = float(200 * np.mean(np.abs(p - t) / (np.abs(p) + np.abs(t) + 1e-6)))
    return out


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    preds, trues = [], []
    for x, y in loader:
        preds.append(model(x.to(device, non_blocking=True)).float().cpu())
        trues.append(y)
    model.train()
    return torch.cat(preds).numpy(), torch.cat(trues).numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    with h5py.File(args.data, "r") as f:
        arr = f["values"][:].astype(np.float32)  # (T, C)
    n = len(arr)
    n_tr, n_va = int(0.7 * n), int(0.1 * n)
    mean, std = arr[:n_tr].mean(0), arr[:n_tr].std(0) + 1e-6
    arr = (arr - mean) / std
    train_ds = PlantWindows(arr[:n_tr], args.lookback, args.horizon)
    val_ds = PlantWindows(arr[n_tr - args.lookback:n_tr + n_va], args.lookback, args.horizon, step=4)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                        num_workers=args.workers, pin_memory=True)

    model = DDP(PatchTST(args).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world, pct_start=0.3,
                                                epochs=args.epochs, steps_per_epoch=len(train_dl))
    criterion = nn.MSELoss()

    writer = SummaryWriter(args.out) if rank == 0 else None
    best_mae = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        run_loss = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            run_loss[0] += loss.detach()
            run_loss[1] += 1
        dist.all_reduce(run_loss)

        preds, trues = predict(model, val_dl, device)
        metrics = horizon_metrics(preds, trues)
        mean_mae = float(np.mean([metrics[f"mae_{k}"] for k in HORIZON_BUCKETS]))

        if rank == 0:
            writer.add_scalar("train/mse", (run_loss[0] / run_loss[1]).item(), epoch)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            print(f"epoch {epoch} mean-MAE {mean_mae:.4f} "
                  f"mae_24h {metrics['mae_24h']:.4f} ({time.time() - tic:.0f}s)", flush=True)
            if mean_mae < best_mae:
                best_mae = mean_mae
                torch.save({"state_dict": model.module.state_dict(),
                            "mean": torch.from_numpy(mean), "std": torch.from_numpy(std),
                            "epoch": epoch, "metrics": metrics},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
