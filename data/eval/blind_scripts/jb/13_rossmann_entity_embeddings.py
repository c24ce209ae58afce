#!/usr/bin/env python
# Rossmann store sales - entity-embedding MLP (Guo & Berkhahn 2016) with a small attention
# block over the categorical embeddings, trained with DDP.  Validation = last 6 weeks.
#
#   torchrun --nproc_per_node=4 13_rossmann_entity_embeddings.py --data-dir data/rossmann
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_VARS = ["Store", "DayOfWeek", "Year", "Month", "Day", "StateHoliday", "SchoolHoliday", "Promo",
            "StoreType", "Assortment", "PromoInterval", "Promo2", "CompetitionOpenSinceYear", "State",
            "WeekOfYear"]
CONT_VARS = ["CompetitionDistance", "Max_TemperatureC", "Mean_Humidity", "Mean_Wind_SpeedKm_h",
             "CloudCover", "trend", "trend_DE"]


def emb_size(card):
    return min(50, (card + 1) // 2)


class EntityEmbeddingNet(nn.Module):
    def __init__(self, cards, n_cont, d_attn=32, hidden=(1000, 500), emb_drop=0.04, drop=(0.001, 0.01)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_size(c)) for c in cards])
        d_emb = sum(emb_size(c) for c in cards)
        self.proj = nn.ModuleList([nn.Linear(emb_size(c), d_attn) for c in cards])
        self.attn = nn.MultiheadAttention(d_attn, 4, batch_first=True)
        self.attn_norm = nn.LayerNorm(d_attn)
        self.emb_drop = nn.Dropout(emb_drop)
        self.cont_bn = nn.BatchNorm1d(n_cont)
        layers, prev = [], d_emb + d_attn * len(cards) + n_cont
        for h, p in zip(hidden, drop):
            layers += [nn.Linear(prev, h), nn.ReLU(inplace=True), nn.BatchNorm1d(h), nn.Dropout(p)]
            prev = h
        layers.append(nn.Linear(prev, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x_cat, x_cont):
        e = [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        tok = torch.stack([p(v) for p, v in zip(self.proj, e)], 1)
        a, _ = self.attn(tok, tok, tok, need_weights=False)
        ctx = self.attn_norm(tok + a).flatten(1)
        x = torch.cat([self.emb_drop(torch.cat(e, 1)), ctx, self.cont_bn(x_cont)], 1)
        return self.mlp(x).squeeze(-1)


def rmspe(y_true, y_pred):
    m = y_true != 0
    return np.sqrt(np.mean(((y_true[m] - y_pred[m]) / y_true[m]) ** 2))


def load(data_dir):
    # joined_train.feather is the classic fast.ai joined table (train + store + weather + trends)
    df = pd.read_feather(os.path.join(data_dir, "joined_train.feather"))
    df = df[df["Sales"] > 0].reset_index(drop=True)
    df["Date"] = pd.to_datetime(df["Date"])
    df = df.sort_values("Date").reset_index(drop=True)
    cards = []
    for c in CAT_VARS:
        codes = df[c].astype("category").cat.codes.astype(np.int64) + 1
        df[c] = codes
        cards.append(int(codes.max()) + 1)
    df[CONT_VARS] = df[CONT_VARS].fillna(df[CONT_VARS].median())
    df["CompetitionDistance"] = np.log1p(df["CompetitionDistance"])
    return df, cards


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", default="runs/rossmann")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=512, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-weeks", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    df, cards = load(args.data_dir)
    cutoff = df["Date"].max() - pd.Timedelta(weeks=args.val_weeks)
    tr, va = df[df["Date"] <= cutoff], df[df["Date"] > cutoff]
    mu, sd = tr[CONT_VARS].mean(), tr[CONT_VARS].std()
    y_max = np.log(tr["Sales"].max()) * 1.2

    def tensors(frame):
        return (torch.tensor(frame[CAT_VARS].values, dtype=torch.long),
                torch.tensor(((frame[CONT_VARS] - mu) / sd).values, dtype=torch.float32),
                torch.tensor(np.log(frame["Sales"].values) / y_max, dtype=torch.float32))

    tr_ds = TensorDataset(*tensors(tr))
    va_cat, va_cont, _ = tensors(va)
    sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(tr_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(EntityEmbeddingNet(cards, len(CONT_VARS))).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warmup = len(loader)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / world, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader) - warmup),
    ], milestones=[warmup])
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")

    rows = np.arange(rank, len(va), world)
    best = np.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for xc, xn, yb in loader:
            xc, xn, yb = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(xc, xn), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        net.eval()
        with torch.no_grad():
            p = torch.cat([net(va_cat[rows[i:i + 8192]].to(device), va_cont[rows[i:i + 8192]].to(device)).cpu()
                           for i in range(0, len(rows), 8192)]).numpy()
        shards = [None] * world
        dist.all_gather_object(shards, (rows, p))
        pred = np.empty(len(va), np.float32)
        for r, q in shards:
            pred[r] = q
        score = rmspe(va["Sales"].values, np.exp(pred * y_max))
        if rank == 0:
            print(f"epoch {epoch} train_mse {(run[0] / run[1]).item():.5f} val_rmspe {score:.5f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
        if score < best:
            best = score
            torch.save({"model": net.state_dict(), "epoch": epoch, "rmspe": float(score),
                        "y_max": float(y_max)}, best_path)

    ckpt = torch.load(best_path, map_location=device)
    net.load_state_dict(ckpt["model"])
    net.eval()
    with torch.no_grad():
        p = torch.cat([net(va_cat[rows[i:i + 8192]].to(device), va_cont[rows[i:i + 8192]].to(device)).cpu()
                       for i in range(0, len(rows), 8192)]).numpy()
    dist.all_gather_object(shards, (rows, p))
    for r, q in shards:
        pred[r] = q
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} val RMSPE {ckpt['rmspe']:.5f}")
        pd.DataFrame({"Store": va["Store"].values, "Date": va["Date"].values,
                      "Sales": va["Sales"].values, "pred": np.exp(pred * y_max)}).to_csv(
            os.path.join(args.out, "val_predictions.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
