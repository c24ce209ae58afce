"""Multi-horizon TCN for daily net sales per (store, subcategory).

Checkpoints go to shared storage so that interrupted runs can be resumed:
    torchrun --nproc_per_node=8 19_tcn_daily_sales.py --data /shared/sales/subcat_daily.parquet \
        --ckpt_dir /shared/ckpt/tcn_subcat
"""
import argparse
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


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/sales/subcat_daily.parquet")
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/tcn_subcat")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--horizon", type=int, default=21)
    ap.add_argument("--n_backtest", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=80)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=35)
    return ap.parse_args()


def read_panel(path):
    df = pd.read_parquet(path, columns=["store", "subcat", "date", "net_sales", "promo_share"])
    idx = ["store", "subcat"]
    y = df.pivot_table(index=idx, columns="date", values="net_sales", aggfunc="sum").fillna(0.0)
    promo = df.pivot_table(index=idx, columns="date", values="promo_share").reindex(y.index).fillna(0.0)
    dates = pd.DatetimeIndex(y.columns)
    cal = np.stack([np.sin(2 * np.pi * dates.dayofweek / 7), np.cos(2 * np.pi * dates.dayofweek / 7),
                    np.sin(2 * np.pi * dates.dayofyear / 365.25), np.cos(2 * np.pi * dates.dayofyear / 365.25)])
    return y.to_numpy(np.float32), promo.to_numpy(np.float32), cal.astype(np.float32)


class DailyWindows(Dataset):
    def __init__(self, y, promo, cal, scale, c, h, end):
        self.y, self.promo, self.cal, self.scale, self.c, self.h = y, promo, cal, scale, c, h
        self.ix = [(s, t) for s in range(len(y)) for t in range(0, end - c - h + 1, 3)]

    def __len__(self):
        return len(self.ix)

    def __getitem__(self, i):
        s, t = self.ix[i]
        return make_input(self.y, self.promo, self.cal, self.scale, s, t, self.c, self.h)


def make_input(y, promo, cal, scale, s, t, c, h):
    hist = y[s, t:t + c] / scale[s]
    x = np.concatenate([hist[None], promo[s, t:t + c][None], cal[:, t:t + c]], 0)
    future = np.concatenate([promo[s, t + c:t + c + h][None], cal[:, t + c:t + c + h]], 0)
    target = y[s, t + c:t + c + h] / scale[s]
    return torch.from_numpy(x), torch.from_numpy(future), torch.from_numpy(target)


class GatedBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.dilation = dilation
        self.filt = nn.Conv1d(ch, ch, 2, dilation=dilation)
        self.gate = nn.Conv1d(ch, ch, 2, dilation=dilation)
        self.norm = nn.GroupNorm(8, ch)

    def forward(self, x):
        xp = F.pad(x, (self.dilation, 0))
        return x + self.norm(torch.tanh(self.filt(xp)) * torch.sigmoid(self.gate(xp)))


class TCNMultiHorizon(nn.Module):
    def __init__(self, c_in, c_fut, hidden, blocks, horizon):
        super().__init__()
        self.inp = nn.Conv1d(c_in, hidden, 1)
        self.blocks = nn.Sequential(*[GatedBlock(hidden, 2 ** b) for b in range(blocks)])
        self.fut = nn.Linear(c_fut, hidden)
        self.dec = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x, future):
        h = self.blocks(self.inp(x))[..., -1]                    # B, H
        f = self.fut(future.transpose(1, 2))                     # B, h, H
        z = torch.cat([h.unsqueeze(1).expand(-1, f.size(1), -1), f], -1)
        return self.dec(z).squeeze(-1)


def save_checkpoint(path, model, opt, sched, epoch, best):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "epoch": epoch, "best": best}, path)


@torch.no_grad()
def backtest(net, y, promo, cal, scale, args, rank, world, device):
    net.eval()
    T = y.shape[1]
    rows = np.arange(rank, len(y), world)
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for k in range(args.n_backtest, 0, -1):
        cut = T - k * args.horizon
        for b in range(0, len(rows), 1024):
            batch = [make_input(y, promo, cal, scale, s, cut - args.context, args.context, args.horizon)
                     for s in rows[b:b + 1024]]
            x, fut, tgt = (torch.stack(t).to(device) for t in zip(*batch))
            sc = torch.from_numpy(scale[rows[b:b + 1024], None]).to(device)
            p = net(x, fut).clamp_min(0) * sc
            acc[0] += (p - tgt * sc).abs().sum().double()
            acc[1] += (tgt * sc).abs().sum().double()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(21)

    y, promo, cal = read_panel(args.data)
    T = y.shape[1]
    train_end = T - args.n_backtest * args.horizon
    scale = np.maximum(y[:, :train_end].mean(1), 1.0).astype(np.float32)
    ds = DailyWindows(y, promo, cal, scale, args.context, args.horizon, train_end)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    model = TCNMultiHorizon(2 + cal.shape[0], 1 + cal.shape[0], args.hidden, args.blocks, args.horizon)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader))

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last = os.path.join(args.ckpt_dir, "last.pt")
    start, best = 0, float("inf")
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resuming at epoch {start}")
    dist.barrier()

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, fut, tgt in loader:
            x, fut, tgt = x.to(device, non_blocking=True), fut.to(device, non_blocking=True), tgt.to(device)
            loss = F.l1_loss(model(x, fut), tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        wape = backtest(model.module, y, promo, cal, scale, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} l1 {(acc[0] / acc[1]).item():.4f} backtest_wape {wape:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        if wape < best:
            best = wape
            save_checkpoint(os.path.join(args.ckpt_dir, "best.pt"), model, opt, sched, epoch, best)
        save_checkpoint(last, model, opt, sched, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
