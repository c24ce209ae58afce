"""DeepAR (Salinas et al.) with a negative-binomial likelihood for daily store x family sales.

Input: a long-format CSV with columns date, store_nbr, family, sales, onpromotion
(Favorita "store sales" competition layout).

    torchrun --nproc_per_node=4 08_deepar_store_sales.py --csv data/store_sales/train.csv
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="runs/deepar_sales")
    p.add_argument("--context", type=int, default=56)
    p.add_argument("--prediction", type=int, default=16)
    p.add_argument("--val-days", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--emb", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="single-GPU lr, scaled linearly")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--windows-per-series", type=int, default=50)
    return p.parse_args()


def load_panel(path):
    df = pd.read_csv(path, parse_dates=["date"])
    df["key"] = df["store_nbr"].astype(str) + "_" + df["family"]
    sales = df.pivot(index="date", columns="key", values="sales").sort_index()
    promo = df.pivot(index="date", columns="key", values="onpromotion").reindex(sales.index)
    sales = sales.asfreq("D").fillna(0.0)
    promo = promo.reindex(sales.index).fillna(0.0)
    dates = sales.index
    time_feats = np.stack([dates.dayofweek / 6.0 - 0.5, dates.day / 30.0 - 0.5,
                           (dates.month - 1) / 11.0 - 0.5], 1).astype(np.float32)
    y = sales.to_numpy(np.float32).T  # (N, T)
    pr = np.log1p(promo.to_numpy(np.float32).T)
    return y, pr, time_feats, list(sales.columns)


class SalesWindows(Dataset):
    def __init__(self, y, promo, time_feats, ctx, pred, t_end, windows_per_series=None, seed=0):
        self.y, self.promo, self.tf = y, promo, time_feats
        self.ctx, self.pred = ctx, pred
        win = ctx + pred
        if windows_per_series is None:  # one window per series ending at t_end
            self.index = [(i, t_end - win) for i in range(len(y))]
        else:
            rng = np.random.default_rng(seed)
            starts = rng.integers(0, t_end - win + 1, size=(len(y), windows_per_series))
            self.index = [(i, int(s)) for i in range(len(y)) for s in starts[i]]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        e = s + self.ctx + self.pred
        target = self.y[i, s:e]
        scale = 1.0 + target[:self.ctx].mean()
        covs = np.concatenate([self.tf[s:e], self.promo[i, s:e, None]], axis=1)
        return (torch.from_numpy(target / scale), torch.from_numpy(covs), torch.tensor(i),
                torch.tensor(scale, dtype=torch.float32))


class DeepAR(nn.Module):
    def __init__(self, n_series, n_cov, emb, hidden, layers, dropout):
        super().__init__()
        self.embed = nn.Embedding(n_series, emb)
        self.rnn = nn.LSTM(1 + n_cov + emb, hidden, layers, batch_first=True, dropout=dropout)
        self.mu = nn.Linear(hidden, 1)
        self.alpha = nn.Linear(hidden, 1)

    def forward(self, y_lag, covs, sid, state=None):
        e = self.embed(sid).unsqueeze(1).expand(-1, y_lag.shape[1], -1)
        h, state = self.rnn(torch.cat([y_lag.unsqueeze(-1), covs, e], dim=-1), state)
        mu = F.softplus(self.mu(h)).squeeze(-1) + 1e-6
        alpha = F.softplus(self.alpha(h)).squeeze(-1) + 1e-6
        return mu, alpha, state


def nb_nll(y, mu, alpha):
    r = 1.0 / alpha
    ll = (torch.lgamma(y + r) - torch.lgamma(r) - torch.lgamma(y + 1)
          + r * torch.log(r / (r + mu)) + y * torch.log(mu / (r + mu)))
    return -ll


def teacher_forced_loss(model, target, covs, sid, scale, ctx):
    # inputs are the previous step's value; targets are in original units for the NB likelihood
    y_lag = F.pad(target[:, :-1], (1, 0))
    mu, alpha, _ = model(y_lag, covs, sid)
    mu = mu * scale[:, None]
    alpha = alpha / scale[:, None].sqrt()
    y = target * scale[:, None]
    return nb_nll(y, mu, alpha)[:, ctx:].mean()


@torch.no_grad()
def forecast_mean(net, target, covs, sid, scale, ctx, pred):
    _, _, state = net(F.pad(target[:, :ctx - 1], (1, 0)), covs[:, :ctx], sid)
    last = target[:, ctx - 1:ctx]
    outs = []
    for t in range(pred):
        mu, _, state = net(last, covs[:, ctx + t:ctx + t + 1], sid, state)
        outs.append(mu)
        last = mu
    return torch.cat(outs, 1) * scale[:, None]


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    y, promo, tf, keys = load_panel(args.csv)
    T = y.shape[1]
    train_end = T - args.val_days
    train_ds = SalesWindows(y, promo, tf, args.context, args.prediction, train_end,
                            windows_per_series=args.windows_per_series)
    val_ds = SalesWindows(y, promo, tf, args.context, args.prediction, T)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1024, num_workers=2)

    net = DeepAR(len(keys), tf.shape[1] + 1, args.emb, args.hidden, args.layers, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(keys)} series x {T} days; {len(train_ds)} training windows", flush=True)

    best, bad = math.inf, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        train_sum, train_n = 0.0, 0
        for target, covs, sid, scale in train_loader:
            target, covs = target.to(device, non_blocking=True), covs.to(device, non_blocking=True)
            sid, scale = sid.to(device, non_blocking=True), scale.to(device, non_blocking=True)
            loss = teacher_forced_loss(model, target, covs, sid, scale, args.context)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            train_sum += loss.item()
            train_n += 1

        # the validation set is small (one window per series), every rank scores all of it
        net.eval()
        nll_sum, abs_err, abs_y, n = 0.0, 0.0, 0.0, 0
        with torch.no_grad():
            for target, covs, sid, scale in val_loader:
                target, covs, sid, scale = target.to(device), covs.to(device), sid.to(device), scale.to(device)
                nll_sum += teacher_forced_loss(net, target, covs, sid, scale, args.context).item() * len(sid)
                n += len(sid)
                fc = forecast_mean(net, target, covs, sid, scale, args.context, args.prediction)
                truth = target[:, args.context:] * scale[:, None]
                abs_err += (fc - truth).abs().sum().item()
                abs_y += truth.abs().sum().item()
        val_nll, val_wape = nll_sum / n, abs_err / max(abs_y, 1e-8)

        if rank == 0:
            print(f"epoch {epoch:02d} train {train_sum / max(train_n, 1):.4f} val_nll {val_nll:.4f} "
                  f"val_wape {val_wape:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if val_nll < best:
            best, bad = val_nll, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "keys": keys, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
