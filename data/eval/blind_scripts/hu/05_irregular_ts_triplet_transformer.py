"""Irregularly-sampled ICU time series as (time, variable, value) triplets.

Each observation becomes one token; a transformer encodes the set of tokens of a stay
and predicts decompensation within the stay. Raw extraction from the lab/chart event
tables is slow, so the tokenized cohort is cached next to the raw data.

    torchrun --nproc_per_node=8 05_irregular_ts_triplet_transformer.py \
        --raw_dir /lustre/ehr/mimic-iv-2.2 --cache_dir /lustre/ehr/cache
"""
import argparse
import hashlib
import json
import math
import os
import pickle

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VARIABLES = [
    "heart_rate", "sbp", "dbp", "mbp", "resp_rate", "temperature", "spo2", "glucose",
    "lactate", "creatinine", "bun", "wbc", "hemoglobin", "platelets", "sodium", "potassium",
    "bicarbonate", "bilirubin_total", "inr", "gcs_total",
]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw_dir", required=True)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--out", default="/lustre/ehr/runs/triplet_tf")
    p.add_argument("--max_obs", type=int, default=1024)
    p.add_argument("--window_h", type=float, default=48.0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=25)
    return p.parse_args()


def extract_triplets(raw_dir, window_h):
    """Reads the derived vitals/labs long table and the stay/label table."""
    stays = pd.read_csv(os.path.join(raw_dir, "derived", "icustays_labeled.csv.gz"),
                        usecols=["stay_id", "subject_id", "intime", "split", "label"],
                        parse_dates=["intime"])
    obs = pd.read_csv(os.path.join(raw_dir, "derived", "vitals_labs_long.csv.gz"),
                      usecols=["stay_id", "charttime", "variable", "value"],
                      parse_dates=["charttime"])
    obs = obs[obs.variable.isin(VARIABLES)].merge(stays[["stay_id", "intime"]], on="stay_id")
    obs["t"] = (obs.charttime - obs.intime).dt.total_seconds() / 3600.0
    obs = obs[(obs.t >= 0) & (obs.t < window_h)].dropna(subset=["value"])
    var_idx = {v: i for i, v in enumerate(VARIABLES)}
    obs["var"] = obs.variable.map(var_idx)

    # per-variable standardization with training-split statistics only
    train_ids = set(stays.loc[stays.split == "train", "stay_id"])
    stats = obs[obs.stay_id.isin(train_ids)].groupby("var").value.agg(["mean", "std"])
    obs["z"] = (obs.value - obs["var"].map(stats["mean"])) / obs["var"].map(stats["std"]).clip(lower=1e-6)
    obs["z"] = obs["z"].clip(-5, 5)

    data = {"train": [], "val": [], "test": []}
    groups = obs.sort_values("t").groupby("stay_id")
    for row in stays.itertuples():
        if row.stay_id not in groups.groups:
            continue
        g = groups.get_group(row.stay_id)
        trip = np.stack([g.t.values, g["var"].values, g.z.values], axis=1).astype(np.float32)
        data[row.split].append((trip, int(row.label)))
    return data


def load_or_build(raw_dir, cache_dir, window_h):
    key = hashlib.md5(json.dumps([raw_dir, window_h, VARIABLES]).encode()).hexdigest()[:10]
    path = os.path.join(cache_dir, f"triplets_{key}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    data = extract_triplets(raw_dir, window_h)
    os.makedirs(cache_dir, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    return data


class TripletDataset(Dataset):
    def __init__(self, items, max_obs):
        self.items, self.max_obs = items, max_obs

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        trip, y = self.items[i]
        if len(trip) > self.max_obs:  # keep the most recent observations
            trip = trip[-self.max_obs:]
        return torch.from_numpy(trip), float(y)


def collate(batch):
    n = max(len(t) for t, _ in batch)
    out = torch.zeros(len(batch), n, 3)
    mask = torch.ones(len(batch), n, dtype=torch.bool)  # True = padding
    for i, (t, _) in enumerate(batch):
        out[i, : len(t)] = t
        mask[i, : len(t)] = False
    return out, mask, torch.tensor([y for _, y in batch])


class TimeEncoding(nn.Module):
    def __init__(self, dim, max_period=1000.0):
        super().__init__()
        half = dim // 2
        self.register_buffer("freqs", torch.exp(-math.log(max_period) * torch.arange(half) / half))

    def forward(self, t):
        a = t.unsqueeze(-1) * self.freqs
        return torch.cat([a.sin(), a.cos()], dim=-1)


class TripletTransformer(nn.Module):
    def __init__(self, n_vars, dim, depth):
        super().__init__()
        self.var_emb = nn.Embedding(n_vars, dim)
        self.val_proj = nn.Linear(1, dim)
        self.time_enc = TimeEncoding(dim)
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 4, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth)
        self.attn_pool = nn.Linear(dim, 1)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 1))

    def forward(self, trip, pad_mask):
        t, v, z = trip[..., 0], trip[..., 1].long(), trip[..., 2:3]
        h = self.var_emb(v) + self.val_proj(z) + self.time_enc(t)
        h = self.enc(h, src_key_padding_mask=pad_mask)
        w = self.attn_pool(h).squeeze(-1).masked_fill(pad_mask, float("-inf"))
        pooled = (torch.softmax(w, dim=1).unsqueeze(-1) * h).sum(1)
        return self.head(pooled).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    ps, ys = [], []
    for trip, mask, y in loader:
        ps.append(torch.sigmoid(model(trip.to(device), mask.to(device))))
        ys.append(y.to(device))
    p, y = torch.cat(ps), torch.cat(ys)
    gp = [torch.zeros_like(p) for _ in range(world)]
    gy = [torch.zeros_like(y) for _ in range(world)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    # unshuffled DistributedSampler deals index i to rank i % world: interleave back and
    # drop the padded tail so each stay counts once
    n = len(loader.dataset)
    p = torch.stack(gp, dim=1).flatten()[:n]
    y = torch.stack(gy, dim=1).flatten()[:n]
    return roc_auc_score(y.cpu().numpy(), p.cpu().numpy())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = load_or_build(args.raw_dir, args.cache_dir, args.window_h)
    train_ds = TripletDataset(data["train"], args.max_obs)
    val_ds = TripletDataset(data["val"], args.max_obs)
    if rank == 0:
        print(f"stays: train={len(train_ds)} val={len(val_ds)} test={len(data['test'])}", flush=True)

    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    tr_loader = DataLoader(train_ds, args.bs, sampler=tr_sampler, collate_fn=collate,
                           num_workers=4, pin_memory=True)
    va_loader = DataLoader(val_ds, 128, sampler=va_sampler, collate_fn=collate, num_workers=4)

    model = DDP(TripletTransformer(len(VARIABLES), args.dim, args.depth).to(device),
                device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_loader))

    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for trip, mask, y in tr_loader:
            trip, mask, y = trip.to(device), mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = model(trip, mask)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        auc = evaluate(model, va_loader, device, world)
        if rank == 0:
            print(f"epoch {epoch}: loss {tot[0].item() / tot[1].item():.4f} val AUROC {auc:.4f}", flush=True)
            if auc > best:
                best = auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
