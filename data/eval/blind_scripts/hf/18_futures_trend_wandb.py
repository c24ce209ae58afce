"""Deep momentum network for a diversified futures portfolio (trend following).

Position sizes come out of an LSTM over normalised returns and MACD signals and
are trained directly on the volatility-scaled Sharpe ratio of the portfolio.
Experiments are tracked in Weights & Biases.

    WANDB_PROJECT=dmn torchrun --nproc_per_node=4 18_futures_trend_wandb.py --data /data/futures/continuous.parquet
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGET_VOL = 0.15


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, default=63)
    p.add_argument("--hidden", type=int, default=40)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    p.add_argument("--val-start", default="2015-01-01")
    p.add_argument("--test-start", default="2020-01-01")
    p.add_argument("--run-name", default=None)
    p.add_argument("--ckpt-dir", default="checkpoints/dmn")
    return p.parse_args()


def macd(px, s, l):
    m = px.ewm(halflife=math.log(0.5) / math.log(1 - 1 / s)).mean() - px.ewm(halflife=math.log(0.5) / math.log(1 - 1 / l)).mean()
    q = m / px.rolling(63).std()
    return q / q.rolling(252).std()


def make_features(df):
    out = []
    for sym, g in df.groupby("symbol"):
        g = g.sort_values("date").copy()
        r = np.log(g["close"]).diff()
        vol = r.ewm(span=60).std()
        g["vol"] = vol
        for n in (1, 21, 63, 126, 252):
            g[f"nret_{n}"] = r.rolling(n).sum() / (vol * np.sqrt(n))
        for s, l in ((8, 24), (16, 48), (32, 96)):
            g[f"macd_{s}_{l}"] = macd(g["close"], s, l)
        g["next_ret"] = r.shift(-1)
        out.append(g)
    return pd.concat(out).dropna()


FEATS = ["nret_1", "nret_21", "nret_63", "nret_126", "nret_252", "macd_8_24", "macd_16_48", "macd_32_96"]


class Sequences(Dataset):
    def __init__(self, df, seq_len, lo, hi):
        self.items = []
        for _, g in df.groupby("symbol"):
            g = g[(g.date >= lo) & (g.date < hi)]
            x = g[FEATS].to_numpy(np.float32).clip(-10, 10)
            scaled = (g["next_ret"] * TARGET_VOL / (g["vol"] * np.sqrt(252))).to_numpy(np.float32)
            for s in range(0, len(g) - seq_len + 1, seq_len):
                self.items.append((x[s : s + seq_len], scaled[s : s + seq_len]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x, y = self.items[i]
        return torch.from_numpy(x), torch.from_numpy(y)


class DMN(nn.Module):
    def __init__(self, n_in, hidden, dropout):
        super().__init__()
        self.lstm = nn.LSTM(n_in, hidden, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.pos = nn.Linear(hidden, 1)

    def forward(self, x):
        h, _ = self.lstm(x)
        return torch.tanh(self.pos(self.drop(h))).squeeze(-1)  # positions in [-1, 1]


def neg_sharpe(pos, scaled_ret):
    captured = pos * scaled_ret
    return -captured.mean() / (captured.std() + 1e-9) * math.sqrt(252)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        c = (model(x.to(device)) * y.to(device)).double()
        s += torch.stack([c.sum(), (c ** 2).sum(), torch.tensor(float(c.numel()), device=device, dtype=torch.float64)])
    dist.all_reduce(s)
    mean = s[0] / s[2]
    std = torch.sqrt(s[1] / s[2] - mean ** 2)
    return (mean / std * math.sqrt(252)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dmn"), name=args.run_name,
                     config={**vars(args), "world_size": world})

    df = pd.read_parquet(args.data)
    df["date"] = pd.to_datetime(df["date"])
    df = make_features(df)
    train_ds = Sequences(df, args.seq_len, pd.Timestamp("1990-01-01"), pd.Timestamp(args.val_start))
    val_ds = Sequences(df, args.seq_len, pd.Timestamp(args.val_start), pd.Timestamp(args.test_start))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=2, drop_last=True)
    val_loader = DataLoader(val_ds, 512, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    model = DDP(DMN(len(FEATS), args.hidden, args.dropout).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    best, step = -float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = neg_sharpe(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/neg_sharpe": loss.item(), "train/grad_norm": gn.item(), "epoch": epoch}, step=step)

        val_sharpe = evaluate(model, val_loader, device)
        wandb.log({"val/sharpe": val_sharpe, "epoch_time": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} val sharpe {val_sharpe:.3f}", flush=True)
            if val_sharpe > best:
                best = val_sharpe
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
                run.summary["best_val_sharpe"] = best
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
