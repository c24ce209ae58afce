"""NBEATSx for day-ahead electricity price forecasting (EPF, e.g. NP/PJM/EPEX).

Hourly prices with exogenous load / wind forecasts.  Validation uses rolling
origins (one per day of the validation year); the final test walks through the
test period day by day.

    torchrun --nproc_per_node=4 20_nbeatsx_epf_rolling.py --market NP
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/epf")
    p.add_argument("--market", default="NP")
    p.add_argument("--out", default="runs/nbeatsx_epf")
    p.add_argument("--days_in", type=int, default=7)
    p.add_argument("--test_days", type=int, default=728)
    p.add_argument("--val_days", type=int, default=364)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--exog_channels", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=200)
    return p.parse_args()


class DayAhead(Dataset):
    """One sample per day d: inputs = prices of the previous days_in days and
    exogenous forecasts for days d-days_in..d; target = 24 hourly prices of day d."""

    def __init__(self, price, exog, dow, days, days_in):
        self.p, self.x, self.dow, self.days, self.k = price, exog, dow, list(days), days_in

    def __len__(self):
        return len(self.days)

    def __getitem__(self, i):
        d = self.days[i]
        hist = self.p[(d - self.k) * 24:d * 24]
        ex = self.x[(d - self.k) * 24:(d + 1) * 24]
        return (torch.from_numpy(hist), torch.from_numpy(ex), torch.tensor(self.dow[d]),
                torch.from_numpy(self.p[d * 24:(d + 1) * 24]))


class XBlock(nn.Module):
    def __init__(self, n_in, width, n_exog_flat, n_x, dropout):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(n_in + n_exog_flat + 7, width), nn.ReLU(), nn.Dropout(dropout),
                                nn.Linear(width, width), nn.ReLU(), nn.Dropout(dropout))
        # theta = [backcast | exog weights per hour | forecast bias]; the forecast is a
        # learned combination of the exog channels of the target day (exogenous basis)
        self.theta = nn.Linear(width, n_in + n_x * 24 + 24)
        self.n_in, self.n_x = n_in, n_x

    def forward(self, res, ex_flat, dow, ex_day):
        h = self.fc(torch.cat([res, ex_flat, dow], -1))
        t = self.theta(h)
        back, tf = t[:, :self.n_in], t[:, self.n_in:]
        w = tf[:, :self.n_x * 24].view(-1, 24, self.n_x)
        f = (w * ex_day).sum(-1) + tf[:, self.n_x * 24:]
        return back, f


class NBEATSx(nn.Module):
    def __init__(self, days_in, n_exog, a):
        super().__init__()
        n_in = days_in * 24
        self.enc = nn.Conv1d(n_exog, a.exog_channels, kernel_size=3, padding=1)
        n_flat = a.exog_channels * (days_in + 1) * 24
        self.blocks = nn.ModuleList([XBlock(n_in, a.width, n_flat, a.exog_channels, a.dropout)
                                     for _ in range(a.blocks)])

    def forward(self, hist, ex, dow):
        e = torch.relu(self.enc(ex.transpose(1, 2)))                       # (B, C, T)
        ex_flat = e.flatten(1)
        ex_day = e[:, :, -24:].transpose(1, 2)                              # (B, 24, C)
        dow1h = F.one_hot(dow, 7).float()
        res, fc = hist, 0.0
        for b in self.blocks:
            back, f = b(res, ex_flat, dow1h, ex_day)
            res = res - back
            fc = fc + f
        return fc


@torch.no_grad()
def evaluate(model, loader, dev, scale):
    model.eval()
    s = torch.zeros(4, device=dev, dtype=torch.float64)
    for hist, ex, dow, y in loader:
        hist, ex, dow, y = hist.to(dev), ex.to(dev), dow.to(dev), y.to(dev)
        pred = model(hist, ex, dow) * scale[1] + scale[0]
        true = y * scale[1] + scale[0]
        err = pred - true
        s += torch.stack([err.abs().sum(), (err ** 2).sum(),
                          (err.abs() / true.abs().clamp(min=1.0)).sum(),
                          torch.tensor(float(y.numel()), device=dev)]).double()
    dist.all_reduce(s)
    model.train()
    n = s[3].item()
    return {"mae": s[0].item() / n, "rmse": (s[1].item() / n) ** 0.5, "mape": 100 * s[2].item() / n}


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    df = pd.read_csv(os.path.join(a.root, f"{a.market}.csv"), index_col=0, parse_dates=True)
    price = df.iloc[:, 0].to_numpy(np.float32)
    exog = df.iloc[:, 1:].to_numpy(np.float32)
    n_days = len(df) // 24
    dow = df.index[::24].dayofweek.to_numpy()
    d_test = n_days - a.test_days
    d_val = d_test - a.val_days
    mu, sd = float(price[:d_val * 24].mean()), float(price[:d_val * 24].std())
    ex_mu, ex_sd = exog[:d_val * 24].mean(0), exog[:d_val * 24].std(0) + 1e-6
    price_n = ((price - mu) / sd).astype(np.float32)
    exog_n = ((exog - ex_mu) / ex_sd).astype(np.float32)
    scale = (mu, sd)

    tr = DayAhead(price_n, exog_n, dow, range(a.days_in, d_val), a.days_in)
    va = DayAhead(price_n, exog_n, dow, range(d_val, d_test), a.days_in)
    te = DayAhead(price_n, exog_n, dow, range(d_test, n_days), a.days_in)
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, a.batch, sampler=sampler, num_workers=4, drop_last=True)
    va_dl = DataLoader(Subset(va, range(rank, len(va), world)), 256)
    # test walks the days in order; rank 0 scores the whole period
    te_dl = DataLoader(te, 24, shuffle=False)

    model = DDP(NBEATSx(a.days_in, exog.shape[1], a).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=a.epochs // 3, gamma=0.5)
    best_path = os.path.join(a.out, f"{a.market}_best.pt")
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    best = float("inf")
    for ep in range(a.epochs):
        sampler.set_epoch(ep)
        t0 = time.time()
        for hist, ex, d, y in tr_dl:
            hist, ex, d, y = hist.to(dev), ex.to(dev), d.to(dev), y.to(dev)
            loss = F.l1_loss(model(hist, ex, d), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        if ep % 5 == 4 or ep == a.epochs - 1:
            m = evaluate(model, va_dl, dev, scale)
            if rank == 0:
                print(f"ep {ep} val {m} ({time.time() - t0:.1f}s/ep)", flush=True)
                if m["mae"] < best:
                    torch.save(model.module.state_dict(), best_path)
            best = min(best, m["mae"])
    dist.barrier()

    if rank == 0:
        model.module.load_state_dict(torch.load(best_path, map_location=dev))
        m = evaluate(model, te_dl, dev, scale)
        print(f"{a.market} test: {m}")
        with open(os.path.join(a.out, f"{a.market}_test.json"), "w") as f:
            json.dump(m, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
