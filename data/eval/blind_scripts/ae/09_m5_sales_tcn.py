"""Temporal conv net for daily unit-sales forecasting (M5 / Walmart).

Windows of `lookback` days predict the next `horizon` days for every item-store series.

    torchrun --nproc_per_node=4 09_m5_sales_tcn.py --data-dir data/m5 --epochs 30
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


class SalesWindows(Dataset):
    """All (series, start) windows with start in [first, last]."""

    def __init__(self, sales, cats, cal_feats, lookback, horizon, first, last, stride=7):
        self.sales = sales            # [S, T] float32, log1p units
        self.cats = cats              # [S, 4] int64: item, dept, store, state
        self.cal = cal_feats          # [T, F] float32
        self.lookback, self.horizon = lookback, horizon
        starts = np.arange(first, last + 1, stride)
        s_idx, t_idx = np.meshgrid(np.arange(sales.shape[0]), starts, indexing="ij")
        self.index = np.stack([s_idx.ravel(), t_idx.ravel()], axis=1)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        hist = self.sales[s, t:t + self.lookback]
        fut = self.sales[s, t + self.lookback:t + self.lookback + self.horizon]
        cal = self.cal[t:t + self.lookback + self.horizon]
        return (torch.from_numpy(hist), torch.from_numpy(cal),
                torch.from_numpy(self.cats[s]), torch.from_numpy(fut))


def load_m5(data_dir):
    sales = pd.read_csv(os.path.join(data_dir, "sales_train_evaluation.csv"))
    cal = pd.read_csv(os.path.join(data_dir, "calendar.csv"))
    day_cols = [c for c in sales.columns if c.startswith("d_")]
    y = np.log1p(sales[day_cols].values.astype(np.float32))
    cats = np.stack([sales[c].astype("category").cat.codes.values
                     for c in ["item_id", "dept_id", "store_id", "state_id"]], axis=1).astype(np.int64)
    cards = [int(cats[:, i].max()) + 1 for i in range(cats.shape[1])]
    cal = cal.iloc[:len(day_cols) + 28]
    feats = np.stack([
        cal["wday"].values / 7.0,
        cal["month"].values / 12.0,
        cal["event_name_1"].notna().values.astype(np.float32),
        cal["snap_CA"].values, cal["snap_TX"].values, cal["snap_WI"].values,
    ], axis=1).astype(np.float32)
    return y, cats, cards, feats


class CausalConv(nn.Module):
    def __init__(self, cin, cout, k, dilation):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv = nn.Conv1d(cin, cout, k, dilation=dilation)

    def forward(self, x):
        return self.conv(F.pad(x, (self.pad, 0)))


class TCNForecaster(nn.Module):
    def __init__(self, cards, n_cal, horizon, channels=64, levels=6, emb_dim=16):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cards)
        self.horizon = horizon
        cin = 1 + n_cal + emb_dim * len(cards)
        self.inp = nn.Conv1d(cin, channels, 1)
        self.blocks = nn.ModuleList(CausalConv(channels, channels, 3, 2 ** i) for i in range(levels))
        self.norms = nn.ModuleList(nn.GroupNorm(4, channels) for _ in range(levels))
        self.head = nn.Linear(channels + n_cal * horizon, horizon)

    def forward(self, hist, cal, cats):
        b, L = hist.shape
        emb = torch.cat([e(cats[:, i]) for i, e in enumerate(self.embs)], dim=-1)
        x = torch.cat([hist.unsqueeze(-1), cal[:, :L], emb.unsqueeze(1).expand(-1, L, -1)], -1)
        h = self.inp(x.transpose(1, 2))
        for conv, norm in zip(self.blocks, self.norms):
            h = h + F.gelu(norm(conv(h)))
        last = h[:, :, -1]
        fut_cal = cal[:, L:].reshape(b, -1)
        return self.head(torch.cat([last, fut_cal], dim=-1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(3, device=device)
    for hist, cal, cats, fut in loader:
        hist, cal, cats, fut = (t.to(device, non_blocking=True) for t in (hist, cal, cats, fut))
        pred = model(hist, cal, cats)
        tot[0] += (torch.expm1(pred).clamp_min(0) - torch.expm1(fut)).pow(2).sum()
        tot[1] += F.mse_loss(pred, fut, reduction="sum")
        tot[2] += fut.numel()
    dist.all_reduce(tot)
    return (tot[0] / tot[2]).sqrt().item(), (tot[1] / tot[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="data/m5")
    ap.add_argument("--lookback", type=int, default=112)
    ap.add_argument("--horizon", type=int, default=28)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-dir", default="checkpoints/m5_tcn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    y, cats, cards, cal = load_m5(args.data_dir)
    T = y.shape[1]
    val_start = T - args.horizon - args.lookback       # last 28 days held out
    train_last = val_start - args.horizon                # no overlap with validation targets
    train_ds = SalesWindows(y, cats, cal, args.lookback, args.horizon, 0, train_last)
    val_ds = SalesWindows(y, cats, cal, args.lookback, args.horizon, val_start, val_start)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = TCNForecaster(cards, cal.shape[1], args.horizon).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)

    os.makedirs(args.save_dir, exist_ok=True)
    logger.info("series=%d train windows=%d val windows=%d steps/epoch=%d",
                y.shape[0], len(train_ds), len(val_ds), len(train_loader))
    best_rmse = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for i, (hist, cal_b, cat_b, fut) in enumerate(train_loader):
            hist, cal_b, cat_b, fut = (t.to(device, non_blocking=True) for t in (hist, cal_b, cat_b, fut))
            pred = model(hist, cal_b, cat_b)
            loss = F.mse_loss(pred, fut)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            if i % 500 == 0:
                logger.info("epoch %d it %d loss %.4f lr %.2e", epoch, i, loss.item(), sched.get_last_lr()[0])
        dist.all_reduce(loss_sum)
        rmse, val_mse = evaluate(model, val_loader, device)
        logger.info("epoch %d train_mse %.4f val_mse %.4f val_rmse(units) %.4f (%.0fs)",
                    epoch, (loss_sum[0] / loss_sum[1]).item(), val_mse, rmse, time.time() - t0)
        if rank == 0:
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "cards": cards}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if rmse < best_rmse:
                best_rmse = rmse
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
