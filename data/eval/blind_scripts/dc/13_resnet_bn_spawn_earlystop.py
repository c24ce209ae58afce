"""Tabular ResNet (BatchNorm variant, Gorishniy et al. 2021) for the energy-consumption regression table.

Runs on the shared 4-GPU workstation without torchrun: processes are started with mp.spawn.

    python 13_resnet_bn_spawn_earlystop.py --data /data/energy/meter_readings.parquet --gpus 4
"""
import argparse
import os
import socket
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.model_selection import GroupShuffleSplit
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CATS = ["building_id", "site_id", "primary_use", "meter"]
TARGET = "meter_reading"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--d-hidden-factor", type=float, default=2.0)
    ap.add_argument("--n-layers", type=int, default=6)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--patience", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/energy_resnet")
    return ap.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ResBlock(nn.Module):
    def __init__(self, d, d_hidden, dropout):
        super().__init__()
        self.norm = nn.BatchNorm1d(d)
        self.lin1 = nn.Linear(d, d_hidden)
        self.lin2 = nn.Linear(d_hidden, d)
        self.dropout = dropout

    def forward(self, x):
        z = F.relu(self.lin1(self.norm(x)))
        z = F.dropout(z, self.dropout, self.training)
        return x + F.dropout(self.lin2(z), self.dropout, self.training)


class TabResNet(nn.Module):
    def __init__(self, n_num, cards, d, d_hidden, n_layers, dropout, d_emb=8):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, d_emb) for c in cards)
        self.first = nn.Linear(n_num + d_emb * len(cards), d)
        self.blocks = nn.Sequential(*[ResBlock(d, d_hidden, dropout) for _ in range(n_layers)])
        self.last_norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 1)

    def forward(self, xn, xc):
        x = torch.cat([xn] + [e(xc[:, i]) for i, e in enumerate(self.embs)], 1)
        x = self.blocks(self.first(x))
        return self.head(F.relu(self.last_norm(x))).squeeze(-1)


def prepare(args):
    df = pd.read_parquet(args.data)
    y = np.log1p(df[TARGET].clip(lower=0).values).astype(np.float32)
    # hold out whole buildings so validation measures generalisation to unseen meters
    gss = GroupShuffleSplit(n_splits=1, test_size=0.15, random_state=args.seed)
    tr_idx, va_idx = next(gss.split(df, groups=df["building_id"]))
    num = [c for c in df.columns if c not in CATS + [TARGET, "timestamp"]]
    cards, xc = [], []
    for c in CATS:
        cats = pd.Index(np.sort(df[c].astype(str).unique()))
        cards.append(len(cats))
        xc.append(cats.get_indexer(df[c].astype(str)))
    xc = np.stack(xc, 1).astype(np.int64)
    med = df.iloc[tr_idx][num].median()
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=1000, subsample=500_000, random_state=args.seed)
    qt.fit(df.iloc[tr_idx][num].fillna(med).values)
    xn = qt.transform(df[num].fillna(med).values).astype(np.float32)
    mk = lambda ix: TensorDataset(torch.from_numpy(xn[ix]), torch.from_numpy(xc[ix]), torch.from_numpy(y[ix]))
    return mk(tr_idx), mk(va_idx), len(num), cards


@torch.no_grad()
def val_rmsle(model, ds, rank, world, device):
    model.eval()
    xn, xc, y = ds.tensors
    sel = torch.arange(rank, len(y), world)
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(sel), 16384):
        j = sel[i:i + 16384]
        p = model(xn[j].to(device), xc[j].to(device))
        acc[0] += ((p - y[j].to(device)) ** 2).sum().double()
        acc[1] += len(j)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).sqrt().item()


def worker(rank, world, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    # every process builds the same split (fixed random_state) instead of shipping arrays through /dev/shm
    train_ds, val_ds, n_num, cards = prepare(args)
    net = TabResNet(n_num, cards, args.d, int(args.d * args.d_hidden_factor), args.n_layers, args.dropout)
    # per-GPU batches are small, so normalise over the global batch
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)

    best, bad = float("inf"), 0
    ckpt = os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(xn, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        rmsle = val_rmsle(model.module, val_ds, rank, world, device)
        improved = rmsle < best
        if improved:
            best, bad = rmsle, 0
            if rank == 0:
                torch.save(model.state_dict(), ckpt)
        else:
            bad += 1
        if rank == 0:
            print(f"epoch {epoch:3d} val_rmsle {rmsle:.4f} best {best:.4f} ({time.time() - t0:.0f}s)", flush=True)
        stop = torch.tensor([1 if bad >= args.patience else 0], device=device)
        dist.broadcast(stop, src=0)
        if stop.item():
            break

    dist.barrier()
    # reload the best weights (saved from the DDP wrapper) into a plain model for the final report
    state = torch.load(ckpt, map_location=device)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    final = TabResNet(n_num, cards, args.d, int(args.d * args.d_hidden_factor), args.n_layers, args.dropout).to(device)
    final.load_state_dict(state)
    final_rmsle = val_rmsle(final, val_ds, rank, world, device)
    if rank == 0:
        print(f"reloaded best checkpoint: val_rmsle {final_rmsle:.4f}", flush=True)
    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    port = free_port()
    mp.spawn(worker, args=(args.gpus, args, port), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
