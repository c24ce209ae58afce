"""Post-earnings-announcement drift classifier.

Each sample is one earnings event: pre-announcement price/volume path, surprise
features (SUE, revenue surprise, guidance flags) and the day-0 reaction. Target:
sign of the abnormal return over days +2..+60. The evaluation forms long/short
portfolios from the events that pass a liquidity screen.

    torchrun --nproc_per_node=4 15_earnings_drift_events.py --events /data/events/earnings.parquet
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

log = logging.getLogger("pead")

PATH_LEN = 40
SURPRISE_COLS = ["sue", "rev_surprise", "guide_up", "guide_down", "day0_car", "day0_turnover", "analyst_disp", "log_mcap"]


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--test-year", type=int, default=2021)
    p.add_argument("--min-adv-usd", type=float, default=5e6, help="liquidity screen for the portfolio")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="runs/pead")
    return p.parse_args()


class EventSet(Dataset):
    def __init__(self, df):
        path = np.stack(df["pre_path"].values).astype(np.float32)  # (N, PATH_LEN, 2) returns, log volume
        self.path = torch.from_numpy(path)
        self.tab = torch.from_numpy(df[SURPRISE_COLS].to_numpy(np.float32))
        self.y = torch.from_numpy((df["car_2_60"].values > 0).astype(np.float32))
        self.car = torch.from_numpy(df["car_2_60"].to_numpy(np.float32))
        self.liquid = torch.from_numpy(df["adv_usd"].to_numpy(np.float64))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.path[i], self.tab[i], self.y[i], self.car[i], self.liquid[i]


class DriftNet(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.path_enc = nn.GRU(2, hidden // 2, batch_first=True, bidirectional=True)
        self.tab_enc = nn.Sequential(nn.Linear(len(SURPRISE_COLS), hidden), nn.GELU())
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(hidden, 1))

    def forward(self, path, tab):
        _, h = self.path_enc(path)
        h = torch.cat([h[0], h[1]], -1)
        return self.head(torch.cat([h, self.tab_enc(tab)], -1)).squeeze(-1)


def main():
    args = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    df = pd.read_parquet(args.events)
    df["year"] = pd.to_datetime(df["announce_date"]).dt.year
    mu = df.loc[df.year < args.test_year - 1, SURPRISE_COLS].mean()
    sd = df.loc[df.year < args.test_year - 1, SURPRISE_COLS].std()
    df[SURPRISE_COLS] = ((df[SURPRISE_COLS] - mu) / sd).clip(-6, 6).fillna(0.0)
    train_ds = EventSet(df[df.year < args.test_year - 1])
    val_ds = EventSet(df[df.year == args.test_year - 1])
    test_ds = EventSet(df[df.year >= args.test_year])

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=2, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, 1024, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))
    test_loader = DataLoader(test_ds, 1024, sampler=DistributedSampler(test_ds, shuffle=False, drop_last=True))

    model = DDP(DriftNet(args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    pos_weight = torch.tensor((1 - train_ds.y.mean()) / train_ds.y.mean(), device=device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log.info("events train=%d val=%d test=%d", len(train_ds), len(val_ds), len(test_ds))

    best_auc_proxy = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for path, tab, y, _, _ in train_loader:
            path, tab, y = path.to(device), tab.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(path, tab), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for path, tab, y, _, _ in val_loader:
                logit = model(path.to(device), tab.to(device))
                hits += torch.stack([((logit > 0).float() == y.to(device)).sum(), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(hits)
        val_acc = (hits[0] / hits[1]).item()
        log.info("epoch %d val_acc %.4f (%.0fs)", epoch, val_acc, time.time() - t0)
        if val_acc > best_auc_proxy:
            best_auc_proxy = val_acc
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    # out-of-sample portfolios: only events that pass the liquidity screen are traded
    net = model.module
    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    net.eval()
    scores, cars = [], []
    with torch.no_grad():
        for path, tab, _, car, adv in test_loader:
            keep = adv >= args.min_adv_usd
            if keep.any():
                scores.append(net(path[keep].to(device), tab[keep].to(device)))
                cars.append(car[keep].to(device))
    scores = torch.cat(scores) if scores else torch.zeros(0, device=device)
    cars = torch.cat(cars) if cars else torch.zeros(0, device=device)
    all_scores = [torch.zeros_like(scores) for _ in range(world)]
    all_cars = [torch.zeros_like(cars) for _ in range(world)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_cars, cars)

    if rank == 0:
        s, c = torch.cat(all_scores).cpu().numpy(), torch.cat(all_cars).cpu().numpy()
        q = pd.qcut(s, 5, labels=False, duplicates="drop")
        by_q = pd.Series(c).groupby(q).mean()
        print("mean CAR(+2,+60) by score quintile:", " ".join(f"{v:+.2%}" for v in by_q.values))
        print(f"long-short Q5-Q1: {by_q.iloc[-1] - by_q.iloc[0]:+.2%} on {len(s)} liquid events")
        pd.DataFrame({"score": s, "car": c}).to_parquet(os.path.join(args.out, "oos_scores.parquet"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
