"""Multi-horizon intraday forecaster for liquid ETFs (1-minute bars).

One shared encoder, one regression head per horizon (5, 15, 60 minutes and
close-of-session). Horizons that run past the session close have no target, so
late-session batches often carry no label for the longer heads.

    torchrun --nproc_per_node=8 10_multihorizon_etf_forecaster.py --bars /data/etf_1m --accum 2
"""
import argparse
import contextlib
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HORIZONS = ("h5", "h15", "h60", "close")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--bars", required=True)
    p.add_argument("--lookback", type=int, default=120)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--ckpt-dir", default="checkpoints/mh_etf")
    return p.parse_args()


class SessionWindows(Dataset):
    """Each file: one symbol-day, arrays x (390, F) and y (390, 4) with NaN where a horizon leaves the session."""

    def __init__(self, files, lookback):
        self.items = []
        self.lookback = lookback
        for f in files:
            z = np.load(f)
            x, y = z["x"].astype(np.float32), z["y"].astype(np.float32)
            for t in range(lookback, x.shape[0]):
                if not np.isnan(y[t - 1, 0]):
                    self.items.append((x, y, t))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x, y, t = self.items[i]
        return torch.from_numpy(x[t - self.lookback : t]), torch.from_numpy(y[t - 1])


class Encoder(nn.Module):
    def __init__(self, n_feat, d, layers, grad_ckpt):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(n_feat, d, 3, padding=1), nn.BatchNorm1d(d), nn.GELU())
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 6, 4 * d, 0.1, batch_first=True, norm_first=True) for _ in range(layers))
        self.grad_ckpt = grad_ckpt

    def forward(self, x):
        h = self.stem(x.transpose(1, 2)).transpose(1, 2)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        return h[:, -1]


class MultiHorizon(nn.Module):
    def __init__(self, n_feat, d, layers, grad_ckpt=False):
        super().__init__()
        self.encoder = Encoder(n_feat, d, layers, grad_ckpt)
        self.heads = nn.ModuleDict({h: nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1)) for h in HORIZONS})

    def forward(self, x, y):
        z = self.encoder(x)
        losses = {}
        for i, name in enumerate(HORIZONS):
            mask = ~torch.isnan(y[:, i])
            if mask.any():
                pred = self.heads[name](z[mask]).squeeze(-1)
                losses[name] = nn.functional.smooth_l1_loss(pred, y[mask, i], beta=5.0)
        return losses


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.bars, "*.npz")))
    split = int(0.9 * len(files))
    train_ds = SessionWindows(files[:split], args.lookback)
    val_ds = SessionWindows(files[split:], args.lookback)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    # validation: each rank takes a disjoint stride, no padded duplicates
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 512, num_workers=2)

    n_feat = train_ds[0][0].shape[1]
    model = MultiHorizon(n_feat, args.d_model, args.layers, args.grad_ckpt)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            if i >= steps_per_epoch * args.accum:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                losses = model(x, y)
                loss = sum(losses.values()) / args.accum
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and i % 500 == 0:
                print(f"epoch {epoch} it {i} " + " ".join(f"{k}={v.item():.3f}" for k, v in losses.items()), flush=True)

        # per-horizon validation MAE; sums and counts reduced over ranks
        net = model.module
        net.eval()
        sums = torch.zeros(2, len(HORIZONS), device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                z = net.encoder(x)
                for j, name in enumerate(HORIZONS):
                    m = ~torch.isnan(y[:, j])
                    if m.any():
                        err = (net.heads[name](z[m]).squeeze(-1) - y[m, j]).abs()
                        sums[0, j] += err.sum().double()
                        sums[1, j] += m.sum()
        dist.all_reduce(sums)
        mae = (sums[0] / sums[1].clamp(min=1)).tolist()
        if rank == 0:
            print(f"epoch {epoch} val MAE(bps) " + " ".join(f"{h}={m:.2f}" for h, m in zip(HORIZONS, mae)) +
                  f" ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "val_mae": mae},
                       os.path.join(args.ckpt_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
