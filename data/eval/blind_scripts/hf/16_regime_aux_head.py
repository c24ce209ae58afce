"""Daily equity-index return forecaster with an auxiliary market-regime head.

Main task: next-week return of the index (regression). Auxiliary task: the
HMM-labelled volatility regime (calm / normal / stressed) for the same week,
switched on after a few epochs of pure return training (curriculum).

    torchrun --nproc_per_node=4 16_regime_aux_head.py --data data/indices_daily.parquet --aux-weight 0.3
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MARKETS = ["SPX", "NDX", "RTY", "SX5E", "DAX", "UKX", "NKY", "HSI", "KOSPI", "ASX200"]


def arguments():
    a = argparse.ArgumentParser()
    a.add_argument("--data", required=True)
    a.add_argument("--window", type=int, default=126)
    a.add_argument("--horizon", type=int, default=5)
    a.add_argument("--hidden", type=int, default=128)
    a.add_argument("--batch-size", type=int, default=128)
    a.add_argument("--epochs", type=int, default=40)
    a.add_argument("--lr", type=float, default=3e-4)
    a.add_argument("--aux-weight", type=float, default=0.3)
    a.add_argument("--aux-start-epoch", type=int, default=5)
    a.add_argument("--test-start", default="2019-01-01")
    a.add_argument("--out", default="runs/regime_aux")
    return a.parse_args()


class IndexWindows(Dataset):
    def __init__(self, df, window, horizon, lo, hi):
        self.window, self.horizon = window, horizon
        self.blocks, self.index = [], []
        for m, g in df.groupby("market"):
            g = g.sort_values("date").reset_index(drop=True)
            feats = g[["ret", "rv_5d", "rv_21d", "term_spread", "credit_spread", "vix_chg"]].to_numpy(np.float32)
            fwd = g["ret"].rolling(horizon).sum().shift(-horizon).to_numpy(np.float32)
            regime = g["hmm_regime"].shift(-horizon).fillna(1).to_numpy(np.int64)
            dates = g["date"].to_numpy()
            b = len(self.blocks)
            self.blocks.append((feats, fwd, regime, MARKETS.index(m)))
            ok = (dates >= np.datetime64(lo)) & (dates < np.datetime64(hi)) & np.isfinite(fwd)
            self.index += [(b, t) for t in np.flatnonzero(ok) if t >= window]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        b, t = self.index[i]
        feats, fwd, regime, mid = self.blocks[b]
        return torch.from_numpy(feats[t - self.window : t]), mid, fwd[t] * 100, regime[t]


class RegimeForecaster(nn.Module):
    def __init__(self, n_feat, hidden, n_markets=len(MARKETS), n_regimes=3):
        super().__init__()
        self.market = nn.Embedding(n_markets, 16)
        self.rnn = nn.GRU(n_feat + 16, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.ret_head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.regime_head = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.GELU(), nn.Linear(hidden // 2, n_regimes))

    def forward(self, x, market, with_regime=False):
        e = self.market(market).unsqueeze(1).expand(-1, x.size(1), -1)
        h, _ = self.rnn(torch.cat([x, e], -1))
        z = h[:, -1]
        ret = self.ret_head(z).squeeze(-1)
        if with_regime:
            return ret, self.regime_head(z)
        return ret, None


def main():
    args = arguments()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    df = pd.read_parquet(args.data)
    df["date"] = pd.to_datetime(df["date"])
    df = df[df.market.isin(MARKETS)]
    train_ds = IndexWindows(df, args.window, args.horizon, "1990-01-01", args.test_start)
    test_ds = IndexWindows(df, args.window, args.horizon, args.test_start, "2100-01-01")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, 512, sampler=test_sampler, num_workers=2)

    model = RegimeForecaster(6, args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} test {len(test_ds)} windows", flush=True)

    log = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        use_aux = args.aux_weight > 0 and epoch >= args.aux_start_epoch
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for x, mkt, y, reg in train_loader:
            x, mkt = x.to(device, non_blocking=True), mkt.to(device, non_blocking=True)
            y, reg = y.to(device, non_blocking=True), reg.to(device, non_blocking=True)
            pred, reg_logits = model(x, mkt, with_regime=use_aux)
            loss_ret = F.mse_loss(pred, y)
            loss = loss_ret
            if use_aux:
                loss_reg = F.cross_entropy(reg_logits, reg)
                loss = loss + args.aux_weight * loss_reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss_ret.detach(), loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        model.eval()
        ev = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, mkt, y, reg in test_loader:
                x, mkt, y, reg = x.to(device), mkt.to(device), y.to(device), reg.to(device)
                pred, reg_logits = model.module(x, mkt, with_regime=True)
                ev += torch.stack([((pred - y) ** 2).sum(), (torch.sign(pred) == torch.sign(y)).sum(),
                                   (reg_logits.argmax(-1) == reg).sum(), torch.tensor(len(y), device=device)]).double()
        dist.all_reduce(ev)
        rec = {"epoch": epoch, "train_mse": (tot[0] / tot[2]).item(), "train_total": (tot[1] / tot[2]).item(),
               "test_rmse": (ev[0] / ev[3]).sqrt().item(), "test_hit": (ev[1] / ev[3]).item(),
               "test_regime_acc": (ev[2] / ev[3]).item(), "aux": use_aux}
        if rank == 0:
            log.append(rec)
            print(json.dumps(rec), f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "log.json"), "w") as fh:
            json.dump(log, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
