"""Global DLinear / NLinear baseline over a large retail panel (~30k series).

Raw data is a long-format parquet; building the normalised (series x time)
matrix and the window index takes ~10 minutes, so it is cached next to the data.

    torchrun --nproc_per_node=8 13_dlinear_panel_cache.py --raw /data/retail/sales.parquet
"""
import argparse
import hashlib
import json
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", default="/data/retail/sales.parquet")
    p.add_argument("--cache_dir", default="/data/retail/cache")
    p.add_argument("--out_dir", default="runs/dlinear")
    p.add_argument("--model", choices=["dlinear", "nlinear"], default="dlinear")
    p.add_argument("--lookback", type=int, default=364)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--kernel", type=int, default=25)
    p.add_argument("--val_weeks", type=int, default=8)
    p.add_argument("--test_weeks", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--epochs", type=int, default=10)
    return p.parse_args()


def build_cache(args, path):
    df = pd.read_parquet(args.raw, columns=["series_id", "date", "qty"])
    mat = df.pivot_table(index="series_id", columns="date", values="qty", aggfunc="sum").fillna(0.0)
    y = np.log1p(mat.to_numpy(np.float32).clip(min=0))
    T = y.shape[1]
    t_val = T - 7 * (args.val_weeks + args.test_weeks)
    mu = y[:, :t_val].mean(1, keepdims=True)
    sd = y[:, :t_val].std(1, keepdims=True) + 1e-3
    y = ((y - mu) / sd).astype(np.float32)
    np.savez(path, y=y, mu=mu, sd=sd, t_val=t_val, ids=mat.index.to_numpy().astype(str))


def cache_path(args):
    key = json.dumps({"raw": args.raw, "mtime": os.path.getmtime(args.raw),
                      "val": args.val_weeks, "test": args.test_weeks}, sort_keys=True)
    return os.path.join(args.cache_dir, f"panel_{hashlib.md5(key.encode()).hexdigest()[:10]}.npz")


class Windows(Dataset):
    def __init__(self, y, L, H, t_lo, t_hi, step):
        self.y, self.L, self.H = y, L, H
        self.t = np.arange(t_lo, t_hi - L - H + 1, step)

    def __len__(self):
        return self.y.shape[0] * len(self.t)

    def __getitem__(self, i):
        s, k = divmod(i, len(self.t))
        t = self.t[k]
        w = self.y[s, t:t + self.L + self.H]
        return torch.from_numpy(w[:self.L]), torch.from_numpy(w[self.L:])


class MovingAvg(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.pool = nn.AvgPool1d(k, stride=1)

    def forward(self, x):  # (B, L)
        pad_l, pad_r = (self.k - 1) // 2, self.k // 2
        x = torch.cat([x[:, :1].expand(-1, pad_l), x, x[:, -1:].expand(-1, pad_r)], 1)
        return self.pool(x.unsqueeze(1)).squeeze(1)


class DLinear(nn.Module):
    def __init__(self, L, H, k):
        super().__init__()
        self.ma = MovingAvg(k)
        self.trend = nn.Linear(L, H)
        self.season = nn.Linear(L, H)
        for lin in (self.trend, self.season):
            nn.init.constant_(lin.weight, 1.0 / L)

    def forward(self, x):
        t = self.ma(x)
        return self.trend(t) + self.season(x - t)


class NLinear(nn.Module):
    def __init__(self, L, H, k=None):
        super().__init__()
        self.lin = nn.Linear(L, H)

    def forward(self, x):
        last = x[:, -1:]
        return self.lin(x - last) + last


@torch.no_grad()
def score(model, loader, dev):
    model.eval()
    acc = torch.zeros(3, device=dev, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        e = model(x) - y
        acc += torch.stack([(e ** 2).sum(), e.abs().sum(), torch.tensor(float(e.numel()), device=dev)]).double()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    os.makedirs(args.cache_dir, exist_ok=True)
    path = cache_path(args)
    if not os.path.exists(path):
        t0 = time.time()
        build_cache(args, path)
        print(f"[rank {rank}] built cache {path} in {time.time() - t0:.0f}s", flush=True)
    cache = np.load(path)
    y, t_val = cache["y"], int(cache["t_val"])
    T = y.shape[1]
    t_test = T - 7 * args.test_weeks
    L, H = args.lookback, args.horizon

    tr = Windows(y, L, H, 0, t_val, 7)
    va = Windows(y, L, H, t_val - L, t_test, H)
    te = Windows(y, L, H, t_test - L, T, H)
    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, args.batch_size, sampler=tr_s, num_workers=8, pin_memory=True, drop_last=True)
    ev = lambda ds: DataLoader(torch.utils.data.Subset(ds, range(rank, len(ds), world)), 8192, num_workers=4)
    va_dl, te_dl = ev(va), ev(te)

    net = (DLinear if args.model == "dlinear" else NLinear)(L, H, args.kernel).to(dev)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.8)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = float("inf")
    for ep in range(args.epochs):
        tr_s.set_epoch(ep)
        t0, tot = time.time(), 0.0
        for x, yt in tr_dl:
            x, yt = x.to(dev, non_blocking=True), yt.to(dev, non_blocking=True)
            loss = F.mse_loss(model(x), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
        sched.step()
        mse, mae = score(model, va_dl, dev)
        if rank == 0:
            print(f"ep {ep} train {tot / len(tr_dl):.4f} val mse {mse:.4f} mae {mae:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if mse < best:
                torch.save(net.state_dict(), os.path.join(args.out_dir, f"{args.model}_best.pt"))
        best = min(best, mse)
        dist.barrier()

    net.load_state_dict(torch.load(os.path.join(args.out_dir, f"{args.model}_best.pt"), map_location=dev))
    mse, mae = score(model, te_dl, dev)
    if rank == 0:
        print(f"test mse {mse:.4f} mae {mae:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
