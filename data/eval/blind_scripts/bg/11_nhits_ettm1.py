"""N-HiTS (Challu et al. 2023) on ETTm1, channel-independent, long horizon.

Training is resumable: rank 0 writes last.pt at the end of every epoch.

    torchrun --nproc_per_node=8 11_nhits_ettm1.py --csv data/ETT/ETTm1.csv --horizon 720
    torchrun --nproc_per_node=8 11_nhits_ettm1.py --csv data/ETT/ETTm1.csv --horizon 720 --resume runs/nhits_ettm1_720/last.pt
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/ETT/ETTm1.csv")
    ap.add_argument("--horizon", type=int, default=96)
    ap.add_argument("--lookback-mult", type=int, default=5)
    ap.add_argument("--pool", type=int, nargs=3, default=[16, 8, 1])
    ap.add_argument("--downsample", type=int, nargs=3, default=[24, 12, 1])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=1, help="blocks per stack")
    ap.add_argument("--batch-size", type=int, default=256, help="global")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class NHiTSBlock(nn.Module):
    def __init__(self, lookback, horizon, pool, downsample, width):
        super().__init__()
        self.pool = nn.MaxPool1d(pool, stride=pool, ceil_mode=True)
        d_in = int(np.ceil(lookback / pool))
        self.n_fore = max(horizon // downsample, 1)
        self.lookback, self.horizon = lookback, horizon
        self.mlp = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.theta = nn.Linear(width, lookback + self.n_fore)

    def forward(self, x):
        theta = self.theta(self.mlp(self.pool(x.unsqueeze(1)).squeeze(1)))
        back, fore = theta[:, :self.lookback], theta[:, self.lookback:]
        if self.n_fore != self.horizon:
            fore = F.interpolate(fore.unsqueeze(1), size=self.horizon, mode="linear", align_corners=False).squeeze(1)
        return back, fore


class NHiTS(nn.Module):
    def __init__(self, lookback, horizon, pools, downsamples, width, blocks_per_stack):
        super().__init__()
        blocks = []
        for p, d in zip(pools, downsamples):
            blocks += [NHiTSBlock(lookback, horizon, p, d, width) for _ in range(blocks_per_stack)]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        level = x[:, -1:]
        residual, forecast = x - level, 0.0
        for blk in self.blocks:
            back, fore = blk(residual)
            residual = residual - back
            forecast = forecast + fore
        return forecast + level


class ChannelWindows(Dataset):
    """Every (channel, start) pair is one univariate sample."""

    def __init__(self, data, lo, hi, lookback, horizon):
        self.data, self.L, self.H = data, lookback, horizon
        self.starts = np.arange(lo, hi - lookback - horizon + 1)
        self.n_ch = data.shape[1]

    def __len__(self):
        return len(self.starts) * self.n_ch

    def __getitem__(self, i):
        t, c = self.starts[i // self.n_ch], i % self.n_ch
        w = self.data[t:t + self.L + self.H, c]
        return torch.from_numpy(w[:self.L].copy()), torch.from_numpy(w[self.L:].copy())


def reduce_sum(t):
    dist.all_reduce(t)
    return t


def main():
    args = parse_args()
    args.out = args.out or f"runs/nhits_ettm1_{args.horizon}"
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    df = pd.read_csv(args.csv)
    data = df.drop(columns=["date"]).to_numpy(np.float32)
    # standard ETT split: 12/4/4 months of 15-minute steps
    n_train, n_val = 12 * 30 * 96, 4 * 30 * 96
    mu, sd = data[:n_train].mean(0), data[:n_train].std(0)
    data = (data - mu) / sd

    L = args.lookback_mult * args.horizon
    train_ds = ChannelWindows(data, 0, n_train, L, args.horizon)
    val_ds = ChannelWindows(data, n_train - L, n_train + n_val, L, args.horizon)
    test_ds = ChannelWindows(data, n_train + n_val - L, n_train + 2 * n_val, L, args.horizon)

    per_gpu = args.batch_size // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loaders = {
        "train": DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=4,
                            pin_memory=True, drop_last=True),
        # eval shards are strided and unpadded, so every window is scored exactly once
        "val": DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024,
                          num_workers=4, pin_memory=True),
        "test": DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=1024,
                           num_workers=4, pin_memory=True),
    }

    net = NHiTS(L, args.horizon, args.pool, args.downsample, args.width, args.blocks).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    start_epoch, best, bad = 0, float("inf"), 0
    if args.resume:
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best, bad = ckpt["epoch"] + 1, ckpt["best"], ckpt["bad"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    def run_eval(split):
        net.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in loaders[split]:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                p = net(x)
                s += torch.stack([((p - y) ** 2).sum().double(), (p - y).abs().sum().double(),
                                  torch.tensor(y.numel(), device=device, dtype=torch.float64)])
        reduce_sum(s)
        net.train()
        return (s[0] / s[2]).item(), (s[1] / s[2]).item()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        if bad >= args.patience:
            break
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in loaders["train"]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.l1_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        val_mse, val_mae = run_eval("val")
        improved = val_mse < best
        best, bad = (val_mse, 0) if improved else (best, bad + 1)
        if rank == 0:
            print(f"epoch {epoch} val mse {val_mse:.4f} mae {val_mae:.4f} {'*' if improved else ''} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best, "bad": bad, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if improved:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    test_mse, test_mae = run_eval("test")
    if rank == 0:
        print(f"horizon {args.horizon}: test mse {test_mse:.4f} mae {test_mae:.4f}")
        with open(os.path.join(args.out, "test.csv"), "w") as f:
            f.write("horizon,mse,mae\n")
            f.write(f"{args.horizon},{test_mse:.6f},{test_mae:.6f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
