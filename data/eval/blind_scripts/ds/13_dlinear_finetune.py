"""DLinear (trend/seasonal decomposition + linear heads) for fresh-food demand.

Optionally starts from a model trained on the whole assortment (--init) and
fine-tunes on one department.  After training, the best checkpoint is reloaded
and scored on the test period.

    torchrun --nproc_per_node=4 13_dlinear_finetune.py --dept FRESH \
        --init /models/dlinear_all/best.pt --out /models/dlinear_fresh
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/data/sales/sku_daily.csv")
    p.add_argument("--dept", default=None)
    p.add_argument("--init", default=None)
    p.add_argument("--out", default="/models/dlinear")
    p.add_argument("--seq_len", type=int, default=336)
    p.add_argument("--pred_len", type=int, default=28)
    p.add_argument("--kernel", type=int, default=25)
    p.add_argument("--val_len", type=int, default=56)
    p.add_argument("--test_len", type=int, default=28)
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--patience", type=int, default=3)
    return p.parse_args()


def load(csv, dept):
    df = pd.read_csv(csv, parse_dates=["date"], dtype={"sku": str, "dept": str})
    if dept:
        df = df[df["dept"] == dept]
    wide = df.pivot_table(index="sku", columns="date", values="qty", aggfunc="sum").fillna(0.0)
    return wide.to_numpy(np.float32)


class MovingAvg(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.pool = nn.AvgPool1d(k, stride=1)

    def forward(self, x):
        front = x[:, :1].repeat(1, (self.k - 1) // 2)
        back = x[:, -1:].repeat(1, self.k // 2)
        return self.pool(torch.cat([front, x, back], 1).unsqueeze(1)).squeeze(1)


class DLinear(nn.Module):
    def __init__(self, seq_len, pred_len, kernel):
        super().__init__()
        self.decomp = MovingAvg(kernel)
        self.trend = nn.Linear(seq_len, pred_len)
        self.seasonal = nn.Linear(seq_len, pred_len)

    def forward(self, x):
        t = self.decomp(x)
        return self.trend(t) + self.seasonal(x - t)


class Windows(Dataset):
    def __init__(self, y, mean, std, seq_len, pred_len, lo, hi):
        self.y, self.mean, self.std = y, mean, std
        self.s, self.p = seq_len, pred_len
        self.ix = [(i, t) for i in range(len(y)) for t in range(max(lo, seq_len), hi - pred_len + 1)]

    def __len__(self):
        return len(self.ix)

    def __getitem__(self, k):
        i, t = self.ix[k]
        x = (self.y[i, t - self.s:t] - self.mean[i]) / self.std[i]
        y = (self.y[i, t:t + self.p] - self.mean[i]) / self.std[i]
        return torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def score(net, y, mean, std, seq_len, pred_len, origin, rank, world, device):
    """MAE (normalised) and WAPE for one forecast origin, summed over all ranks."""
    net.eval()
    rows = np.arange(rank, len(y), world)
    x = (y[rows, origin - seq_len:origin] - mean[rows, None]) / std[rows, None]
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    if len(rows):
        p = net(torch.from_numpy(x).to(device)).double()
        p = p * torch.from_numpy(std[rows, None]).to(device) + torch.from_numpy(mean[rows, None]).to(device)
        t = torch.from_numpy(y[rows, origin:origin + pred_len]).to(device).double()
        acc[0] += (p.clamp_min(0) - t).abs().sum()
        acc[1] += t.abs().sum()
        acc[2] += t.numel()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    y = load(args.csv, args.dept)
    T = y.shape[1]
    test_origin = T - args.test_len
    val_origin = test_origin - args.val_len
    mean = y[:, :val_origin].mean(1).astype(np.float32)
    std = (y[:, :val_origin].std(1) + 1.0).astype(np.float32)

    train_ds = Windows(y, mean, std, args.seq_len, args.pred_len, 0, val_origin)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DLinear(args.seq_len, args.pred_len, args.kernel)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        model.load_state_dict(sd)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, yt in loader:
            x, yt = x.to(device, non_blocking=True), yt.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        # validate on every origin of the validation period, one week apart
        wapes = [score(model.module, y, mean, std, args.seq_len, args.pred_len, o, rank, world, device)
                 for o in range(val_origin, test_origin - args.pred_len + 1, 7)]
        val = float(np.mean(wapes))
        if val < best:
            best, bad_epochs = val, 0
            if rank == 0:
                torch.save(model.state_dict(), best_path)
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} val_wape {val:.4f} best {best:.4f} ({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()
        if bad_epochs >= args.patience:
            break

    # reload best weights into a plain model for the test score
    final = DLinear(args.seq_len, args.pred_len, args.kernel).to(device)
    final.load_state_dict(torch.load(best_path, map_location=device))
    test_wape = score(final, y, mean, std, args.seq_len, args.pred_len, test_origin, rank, world, device)
    if rank == 0:
        print(f"test WAPE ({args.dept or 'all'}): {test_wape:.4f}")
        with open(os.path.join(args.out, "test_metrics.txt"), "w") as f:
            f.write(f"wape\t{test_wape:.6f}\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
