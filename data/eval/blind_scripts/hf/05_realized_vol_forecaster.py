"""Next-day realized volatility forecaster (HAR features + GRU over intraday RV).

Input per stock-day: the last 22 days of 78 five-minute squared returns plus HAR
aggregates (daily / weekly / monthly RV). Target: log realized variance tomorrow.
Loss is QLIKE on the variance scale.

    torchrun --nproc_per_node=4 05_realized_vol_forecaster.py --data /data/rv/ --resume auto
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with train.npz / val.npz")
    p.add_argument("--days", type=int, default=22)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--save-dir", default="ckpt/rv_gru")
    p.add_argument("--resume", default="", help="path, or 'auto' for the latest in --save-dir")
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args()


class RVDataset(Dataset):
    def __init__(self, path, days):
        z = np.load(path)
        self.intraday = torch.from_numpy(np.log(z["rv5"][:, -days:, :] + 1e-10).astype(np.float32))  # (N, days, 78)
        self.har = torch.from_numpy(np.log(z["har"] + 1e-10).astype(np.float32))  # (N, 3)
        self.target = torch.from_numpy(np.log(z["rv_next"] + 1e-10).astype(np.float32))  # (N,)

    def __len__(self):
        return self.target.shape[0]

    def __getitem__(self, i):
        return self.intraday[i], self.har[i], self.target[i]


class RVNet(nn.Module):
    def __init__(self, bins=78, hidden=128):
        super().__init__()
        self.bin_proj = nn.Sequential(nn.Linear(bins, hidden), nn.GELU())
        self.gru = nn.GRU(hidden, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.har_lin = nn.Linear(3, 1)  # linear HAR baseline
        self.head = nn.Sequential(nn.Linear(hidden + 3, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, intraday, har):
        h, _ = self.gru(self.bin_proj(intraday))
        resid = self.head(torch.cat([h[:, -1], har], dim=-1)).squeeze(-1)
        return self.har_lin(har).squeeze(-1) + resid


def qlike(log_pred, log_true):
    # QLIKE on variances: y/f - log(y/f) - 1, written in logs for stability
    d = log_true - log_pred
    return (torch.exp(d) - d - 1.0).mean()


def latest_checkpoint(folder):
    files = sorted(glob.glob(os.path.join(folder, "epoch_*.pt")))
    return files[-1] if files else ""


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for intraday, har, y in loader:
        intraday, har, y = intraday.to(device), har.to(device), y.to(device)
        pred = model(intraday, har)
        s[0] += qlike(pred, y).double() * len(y)
        s[1] += ((pred - y) ** 2).sum().double()
        s[2] += len(y)
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).sqrt().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    train_ds = RVDataset(os.path.join(args.data, "train.npz"), args.days)
    val_ds = RVDataset(os.path.join(args.data, "val.npz"), args.days)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    model = RVNet(hidden=args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size ** 0.5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3)

    start_epoch, best_val, global_step = 0, float("inf"), 0
    resume = latest_checkpoint(args.save_dir) if args.resume == "auto" else args.resume
    if resume:
        ckpt = torch.load(resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_val = ckpt["best_val"]
        global_step = ckpt["global_step"]
        if is_main:
            print(f"resumed from {resume} at epoch {start_epoch}", flush=True)

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if is_main else None
    if is_main:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for intraday, har, y in train_loader:
            intraday = intraday.to(device, non_blocking=True)
            har = har.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = qlike(model(intraday, har), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            global_step += 1
            if is_main and global_step % args.log_every == 0:
                writer.add_scalar("train/qlike", loss.item(), global_step)

        val_qlike, val_rmse = evaluate(model, val_loader, device)
        scheduler.step(val_qlike)
        best_val = min(best_val, val_qlike)
        if is_main:
            writer.add_scalar("val/qlike", val_qlike, epoch)
            writer.add_scalar("val/rmse_log_rv", val_rmse, epoch)
            print(f"epoch {epoch} val_qlike {val_qlike:.5f} val_rmse {val_rmse:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_val": best_val,
                        "global_step": global_step}, os.path.join(args.save_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
