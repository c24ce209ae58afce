"""Embedding-MLP for taxi fare regression (RMSE in dollars), small Trainer class around DDP.

    torchrun --standalone --nproc_per_node=4 15_mlp_taxi_fare_trainer.py \
        --data /data/taxi/trips_2019_10pct --out runs/taxi_mlp --epochs 8
"""
import argparse
import logging
import os
import time
from datetime import datetime

import numpy as np
import pyarrow.dataset as pds
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

CAT = ["pickup_zone", "dropoff_zone", "vendor_id", "rate_code", "payment_type", "hour", "weekday"]
NUM = ["trip_distance", "passenger_count", "pickup_lat", "pickup_lon", "dropoff_lat", "dropoff_lon", "haversine_km"]
TARGET = "fare_amount"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="hive-partitioned parquet folder (month=01..12)")
    ap.add_argument("--val-months", type=int, nargs="+", default=[12])
    ap.add_argument("--out", default="runs/taxi_mlp")
    ap.add_argument("--emb-dim", type=int, default=12)
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 256, 128])
    ap.add_argument("--global-batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def read_table(root, months, include):
    ds = pds.dataset(root, format="parquet", partitioning="hive")
    cond = pds.field("month").isin(months)
    if not include:
        cond = ~cond
    return ds.to_table(filter=cond, columns=CAT + NUM + [TARGET]).to_pandas()


def build(args):
    tr = read_table(args.data, args.val_months, include=False)
    va = read_table(args.data, args.val_months, include=True)
    tr = tr[(tr[TARGET] > 0) & (tr[TARGET] < 500)]
    va = va[(va[TARGET] > 0) & (va[TARGET] < 500)]
    cards, xc_tr, xc_va = [], [], []
    for c in CAT:
        keys = np.sort(tr[c].astype(str).unique())
        cards.append(len(keys) + 1)
        for frame, out in ((tr, xc_tr), (va, xc_va)):
            v = frame[c].astype(str).values
            pos = np.clip(np.searchsorted(keys, v), 0, len(keys) - 1)
            out.append(np.where(keys[pos] == v, pos + 1, 0))
    scaler = StandardScaler().fit(tr[NUM].fillna(0).values)
    mk = lambda f, xc: TensorDataset(torch.tensor(scaler.transform(f[NUM].fillna(0).values), dtype=torch.float32),
                                     torch.tensor(np.stack(xc, 1), dtype=torch.long),
                                     torch.tensor(np.log1p(f[TARGET].values), dtype=torch.float32))
    return mk(tr, xc_tr), mk(va, xc_va), cards


class FareMLP(nn.Module):
    def __init__(self, cards, n_num, emb_dim, hidden):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cards)
        layers, d = [], n_num + emb_dim * len(cards)
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, xn, xc):
        return self.net(torch.cat([xn] + [e(xc[:, i]) for i, e in enumerate(self.embs)], 1)).squeeze(-1)


class Trainer:
    def __init__(self, args, model, train_ds, val_ds, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.model = DDP(model.to(device), device_ids=[device.index])
        self.val_ds = val_ds
        self.train_loader = DataLoader(train_ds, batch_size=args.global_batch // world, shuffle=True,
                                       num_workers=4, pin_memory=True, drop_last=True, persistent_workers=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=1e-5)
        total = args.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=args.lr, total_steps=total, pct_start=0.05)
        self.log = logging.getLogger("trainer")

    def train_epoch(self, epoch):
        self.model.train()
        acc = torch.zeros(2, device=self.device)
        for xn, xc, y in self.train_loader:
            xn, xc, y = (t.to(self.device, non_blocking=True) for t in (xn, xc, y))
            loss = F.mse_loss(self.model(xn, xc), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            acc += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).sqrt().item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        xn, xc, y = self.val_ds.tensors
        sel = torch.arange(self.rank, len(y), self.world)
        s = torch.zeros(3, dtype=torch.float64, device=self.device)
        for i in range(0, len(sel), 32768):
            j = sel[i:i + 32768]
            p = net(xn[j].to(self.device), xc[j].to(self.device))
            dollars = torch.expm1(p.double()) - torch.expm1(y[j].to(self.device).double())
            s += torch.stack([(dollars ** 2).sum(), dollars.abs().sum(), torch.tensor(float(len(j)), device=self.device, dtype=torch.float64)])
        dist.all_reduce(s)
        return (s[0] / s[2]).sqrt().item(), (s[1] / s[2]).item()

    def save(self, path, epoch, rmse):
        torch.save({"model": self.model.module.state_dict(), "epoch": epoch, "rmse": rmse,
                    "saved_at": datetime.now().isoformat()}, path)

    def fit(self):
        best = float("inf")
        for epoch in range(self.args.epochs):
            t0 = time.time()
            train_rmse_log = self.train_epoch(epoch)
            rmse, mae = self.validate()
            if self.rank == 0:
                self.log.info("epoch %d train_rmse(log) %.4f val_rmse $%.3f val_mae $%.3f (%.0fs)",
                              epoch, train_rmse_log, rmse, mae, time.time() - t0)
                if rmse < best:
                    best = rmse
                    self.save(os.path.join(self.args.out, "best.pt"), epoch, rmse)
            dist.barrier()
        return best


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_ds, val_ds, cards = build(args)
    model = FareMLP(cards, len(NUM), args.emb_dim, args.hidden)
    trainer = Trainer(args, model, train_ds, val_ds, rank, world, torch.device("cuda", local_rank))
    best = trainer.fit()
    if rank == 0:
        logging.info("best val RMSE $%.3f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
