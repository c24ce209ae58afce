#!/usr/bin/env python
"""Next road-segment prediction on map-matched Porto taxi trajectories.

Raw POLYLINE trajectories (ECML/PKDD 15) are snapped to the OSM drive network
(nearest segment midpoint within a radius), consecutive duplicates are collapsed,
and the segment sequences are cached so later runs skip the matching step.

    torchrun --nproc_per_node=4 01_porto_mapmatch_nextseg.py \
        --raw data/porto/train.csv --edges data/porto/osm_edges.parquet
"""
import argparse
import json
import logging
import math
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.spatial import cKDTree
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("nextseg")
EARTH_R = 6371000.0


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--edges", required=True, help="parquet with mid_lon / mid_lat per edge")
    p.add_argument("--cache_dir", default="cache/porto")
    p.add_argument("--out_dir", default="runs/porto_nextseg")
    p.add_argument("--radius", type=float, default=50.0, help="matching radius in metres")
    p.add_argument("--min_len", type=int, default=8)
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--emb_dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--val_frac", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--resume", default="")
    return p.parse_args()


def lonlat_to_xy(lon, lat, lat0):
    x = np.radians(lon) * EARTH_R * np.cos(np.radians(lat0))
    y = np.radians(lat) * EARTH_R
    return x, y


def map_match(raw_csv, edges, radius, min_len):
    lat0 = float(edges.mid_lat.mean())
    ex, ey = lonlat_to_xy(edges.mid_lon.values, edges.mid_lat.values, lat0)
    tree = cKDTree(np.stack([ex, ey], axis=1))
    df = pd.read_csv(raw_csv, usecols=["TRIP_ID", "MISSING_DATA", "POLYLINE"])
    df = df[~df.MISSING_DATA.astype(bool)]
    seqs = []
    for poly in df.POLYLINE.values:
        pts = np.asarray(json.loads(poly), dtype=np.float64)
        if len(pts) < min_len:
            continue
        px, py = lonlat_to_xy(pts[:, 0], pts[:, 1], lat0)
        d, idx = tree.query(np.stack([px, py], axis=1), distance_upper_bound=radius)
        idx = idx[np.isfinite(d)]
        if len(idx) == 0:
            continue
        keep = np.concatenate([[True], idx[1:] != idx[:-1]])
        seg = idx[keep]
        if len(seg) >= min_len:
            seqs.append(seg.astype(np.int32))
    return seqs


def load_matched(args, edges):
    name = os.path.splitext(os.path.basename(args.raw))[0]
    cache_path = os.path.join(args.cache_dir, f"{name}_r{int(args.radius)}_l{args.min_len}.pkl")
    if os.path.exists(cache_path):
        with open(cache_path, "rb") as f:
            return pickle.load(f)
    os.makedirs(args.cache_dir, exist_ok=True)
    t0 = time.time()
    seqs = map_match(args.raw, edges, args.radius, args.min_len)
    with open(cache_path, "wb") as f:
        pickle.dump(seqs, f, protocol=pickle.HIGHEST_PROTOCOL)
    log.info("map-matched %d trajectories in %.0fs -> %s", len(seqs), time.time() - t0, cache_path)
    return seqs


class SegmentSeqDataset(Dataset):
    def __init__(self, seqs, max_len):
        self.seqs = seqs
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = torch.from_numpy(self.seqs[i][: self.max_len + 1].astype(np.int64))
        return s[:-1], s[1:]


def make_collate(pad_id):
    def collate(batch):
        xs, ys = zip(*batch)
        lengths = torch.tensor([len(x) for x in xs])
        x = pad_sequence(xs, batch_first=True, padding_value=pad_id)
        y = pad_sequence(ys, batch_first=True, padding_value=-100)
        return x, y, lengths
    return collate


class NextSegmentGRU(nn.Module):
    def __init__(self, num_segments, emb_dim, hidden, layers, dropout):
        super().__init__()
        self.emb = nn.Embedding(num_segments + 1, emb_dim, padding_idx=num_segments)
        self.gru = nn.GRU(emb_dim, hidden, num_layers=layers, batch_first=True,
                          dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, num_segments)

    def forward(self, x):
        h, _ = self.gru(self.emb(x))
        return self.out(self.drop(h))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, tokens
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        mask = y != -100
        stats[0] += F.cross_entropy(logits[mask], y[mask], reduction="sum")
        stats[1] += (logits[mask].argmax(-1) == y[mask]).sum()
        stats[2] += mask.sum()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    edges = pd.read_parquet(args.edges, columns=["mid_lon", "mid_lat"])
    num_segments = len(edges)
    seqs = load_matched(args, edges)

    perm = np.random.default_rng(args.seed).permutation(len(seqs))
    n_val = int(len(seqs) * args.val_frac)
    val_seqs = [seqs[i] for i in perm[:n_val]]
    train_seqs = [seqs[i] for i in perm[n_val:]]
    train_ds = SegmentSeqDataset(train_seqs, args.max_len)
    val_ds = SegmentSeqDataset(val_seqs, args.max_len)
    collate = make_collate(num_segments)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, collate_fn=collate,
                              drop_last=True, persistent_workers=args.workers > 0)
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.workers, pin_memory=True, collate_fn=collate)

    model = NextSegmentGRU(num_segments, args.emb_dim, args.hidden, args.layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.05)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        log.info("segments=%d train=%d val=%d world=%d", num_segments, len(train_ds), len(val_ds), world)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run_loss = torch.zeros((), device=device)
        for step, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run_loss += loss.detach()
            if rank == 0 and step % 200 == 0:
                log.info("ep %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_loader),
                         loss.item(), sched.get_last_lr()[0])
        dist.all_reduce(run_loss)
        train_loss = run_loss.item() / (world * max(1, len(train_loader)))

        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            log.info("epoch %d train %.4f val %.4f acc@1 %.4f ppl %.1f (%.0fs)", epoch, train_loss,
                     val_loss, val_acc, math.exp(min(val_loss, 20)), time.time() - t0)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best_acc": max(best_acc, val_acc)}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if val_acc > best_acc:
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        best_acc = max(best_acc, val_acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
