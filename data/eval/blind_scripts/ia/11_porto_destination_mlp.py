"""Taxi destination prediction from trajectory prefixes (ECML/PKDD 15, Porto).

Re-implementation of the MLP of de Brebisson et al. (2015): the first and last
5 GPS points of a prefix plus embeddings of taxi id, client, stand, quarter-hour
and weekday go through an MLP whose softmax mixes ~3400 destination cluster
centroids. Trained directly on the equirectangular distance to the true end.

    torchrun --nproc_per_node=4 11_porto_destination_mlp.py \
        --train data/porto/train.csv --centroids data/porto/arrival_clusters.npy
"""
import argparse
import ast
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

K = 5
LAT_MEAN, LAT_STD = 41.1573, 0.0738
LON_MEAN, LON_STD = -8.6169, 0.0575


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--train", default="data/porto/train.csv")
    p.add_argument("--centroids", default="data/porto/arrival_clusters.npy")
    p.add_argument("--save_dir", default="checkpoints/porto_dest")
    p.add_argument("--hidden", type=int, default=500)
    p.add_argument("--emb", type=int, default=10)
    p.add_argument("--batch_size", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--n_val", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    return p


def load_porto(path):
    df = pd.read_csv(path, usecols=["CALL_TYPE", "ORIGIN_CALL", "ORIGIN_STAND", "TAXI_ID",
                                    "TIMESTAMP", "MISSING_DATA", "POLYLINE"])
    df = df[~df.MISSING_DATA.astype(bool)]
    df["poly"] = df.POLYLINE.map(lambda s: np.asarray(ast.literal_eval(s), dtype=np.float32))
    df = df[df.poly.map(len) >= 2].reset_index(drop=True)
    ts = pd.to_datetime(df.TIMESTAMP, unit="s")
    df["qhour"] = ts.dt.hour * 4 + ts.dt.minute // 15
    df["wday"] = ts.dt.dayofweek
    df["taxi"] = df.TAXI_ID.astype("category").cat.codes + 1
    df["client"] = df.ORIGIN_CALL.fillna(0).astype(np.int64).clip(upper=57125)
    df["stand"] = df.ORIGIN_STAND.fillna(0).astype(np.int64)
    return df


def encode_prefix(poly):
    lat = (poly[:, 1] - LAT_MEAN) / LAT_STD
    lon = (poly[:, 0] - LON_MEAN) / LON_STD
    pts = np.stack([lat, lon], 1)
    idx_first = np.minimum(np.arange(K), len(pts) - 1)
    idx_last = np.maximum(len(pts) - K + np.arange(K), 0)
    return np.concatenate([pts[idx_first].ravel(), pts[idx_last].ravel()]).astype(np.float32)


class PrefixDataset(Dataset):
    def __init__(self, df, fixed_cut_seed=None):
        self.poly = df.poly.values
        self.meta = df[["taxi", "client", "stand", "qhour", "wday"]].to_numpy(np.int64)
        self.cuts = None
        if fixed_cut_seed is not None:
            rng = np.random.default_rng(fixed_cut_seed)
            self.cuts = [rng.integers(1, len(p) + 1) for p in self.poly]

    def __len__(self):
        return len(self.poly)

    def __getitem__(self, i):
        p = self.poly[i]
        cut = self.cuts[i] if self.cuts is not None else np.random.randint(1, len(p) + 1)
        dest = p[-1][::-1].copy()  # (lat, lon)
        return torch.from_numpy(encode_prefix(p[:cut])), torch.from_numpy(self.meta[i]), torch.from_numpy(dest)


class DestinationMLP(nn.Module):
    def __init__(self, centroids, emb, hidden):
        super().__init__()
        self.register_buffer("centroids", torch.as_tensor(centroids, dtype=torch.float32))  # (C, 2) lat, lon
        self.embs = nn.ModuleList([nn.Embedding(n, emb) for n in (448 + 1, 57125 + 1, 64, 96, 7)])
        self.mlp = nn.Sequential(nn.Linear(4 * K + 5 * emb, hidden), nn.ReLU(),
                                 nn.Linear(hidden, len(centroids)))

    def forward(self, pts, meta):
        e = [m(meta[:, i]) for i, m in enumerate(self.embs)]
        w = self.mlp(torch.cat([pts] + e, 1)).softmax(-1)
        return w @ self.centroids


def equirect_km(pred, true):
    rad = torch.pi / 180
    lat1, lon1, lat2, lon2 = pred[:, 0] * rad, pred[:, 1] * rad, true[:, 0] * rad, true[:, 1] * rad
    x = (lon2 - lon1) * torch.cos(0.5 * (lat1 + lat2))
    y = lat2 - lat1
    return 6371.0 * torch.sqrt(x * x + y * y)


def main():
    args = build_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    df = load_porto(args.train)
    perm = np.random.default_rng(args.seed).permutation(len(df))
    val_df, train_df = df.iloc[perm[: args.n_val]], df.iloc[perm[args.n_val:]]
    train_ds = PrefixDataset(train_df)
    val_ds = PrefixDataset(val_df, fixed_cut_seed=args.seed)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1000, num_workers=2)

    centroids = np.load(args.centroids)
    model = DestinationMLP(centroids, args.emb, args.hidden).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.3)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"train={len(train_ds)} val={len(val_ds)} clusters={len(centroids)} world={world}", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for it, (pts, meta, dest) in enumerate(train_dl):
            pts, meta, dest = pts.to(device), meta.to(device), dest.to(device)
            loss = equirect_km(model(pts, meta), dest).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and it % 1000 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} dist {loss.item():.3f} km", flush=True)
        sched.step()
        dist.all_reduce(tr)

        model.eval()
        va = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for pts, meta, dest in val_dl:
                pts, meta, dest = pts.to(device), meta.to(device), dest.to(device)
                d = equirect_km(model.module(pts, meta), dest)
                va += torch.stack([d.sum().double(), torch.tensor(float(len(d)), device=device, dtype=torch.float64)])
        dist.all_reduce(va)
        val_km = (va[0] / va[1]).item()
        if rank == 0:
            print(f"epoch {epoch} train {(tr[0] / tr[1]).item():.3f} km  val {val_km:.3f} km "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_km < best:
                best = val_km
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_km": val_km},
                           os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
