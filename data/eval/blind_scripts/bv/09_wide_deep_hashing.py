"""Wide & Deep on raw (string) ad-log features with the hashing trick.

No vocabulary files: every categorical value and every cross used by the wide
part is hashed into a fixed number of buckets on the fly in the Dataset.

    torchrun --nnodes=1 --nproc_per_node=8 09_wide_deep_hashing.py --config configs/wd_hash.json
"""
import argparse
import json
import os
import time
from itertools import combinations

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = {
    "train_path": "/nfs/adlogs/2024-02/train",
    "valid_path": "/nfs/adlogs/2024-02/valid",
    "categorical": ["advertiser_id", "campaign_id", "creative_id", "publisher", "placement",
                    "country", "region", "os", "browser", "device_make", "hour", "weekday"],
    "numeric": ["bid_floor", "user_age_days", "imps_24h", "clicks_24h"],
    "cross_pairs": [["advertiser_id", "publisher"], ["creative_id", "placement"], ["os", "hour"]],
    "deep_buckets": 1 << 21,
    "wide_buckets": 1 << 22,
    "emb_dim": 32,
    "hidden": [512, 256, 128],
    "batch_size": 4096,
    "lr_deep": 1e-3,
    "lr_wide": 5e-2,
    "epochs": 3,
    "out_dir": "/nfs/adlogs/models/wide_deep_hash",
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(json.load(f))
    return cfg


class FeatureHasher:
    def __init__(self, categorical, cross_pairs, deep_buckets, wide_buckets):
        self.categorical = categorical
        self.cross_pairs = [tuple(p) for p in cross_pairs]
        self.deep_buckets = deep_buckets
        self.wide_buckets = wide_buckets

    def deep_ids(self, row):
        return [hash(f"{c}={row[c]}") % self.deep_buckets for c in self.categorical]

    def wide_ids(self, row):
        ids = [hash(f"w:{c}={row[c]}") % self.wide_buckets for c in self.categorical]
        ids += [hash(f"x:{a}={row[a]}&{b}={row[b]}") % self.wide_buckets for a, b in self.cross_pairs]
        return ids


class AdLogs(Dataset):
    def __init__(self, path, cfg, hasher):
        self.df = pd.read_parquet(path, columns=cfg["categorical"] + cfg["numeric"] + ["clicked"])
        self.df[cfg["categorical"]] = self.df[cfg["categorical"]].fillna("__na__").astype(str)
        num = self.df[cfg["numeric"]].fillna(0).to_numpy(np.float32)
        self.num = np.sign(num) * np.log1p(np.abs(num))
        self.y = self.df["clicked"].to_numpy(np.float32)
        self.rows = self.df[cfg["categorical"]].to_dict("records")
        self.hasher = hasher

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        row = self.rows[i]
        return (np.asarray(self.hasher.deep_ids(row), dtype=np.int64),
                np.asarray(self.hasher.wide_ids(row), dtype=np.int64),
                self.num[i], self.y[i])


class WideDeep(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n_cat, n_num = len(cfg["categorical"]), len(cfg["numeric"])
        self.wide = nn.EmbeddingBag(cfg["wide_buckets"], 1, mode="sum")
        self.wide_bias = nn.Parameter(torch.zeros(1))
        nn.init.zeros_(self.wide.weight)
        self.emb = nn.Embedding(cfg["deep_buckets"], cfg["emb_dim"])
        nn.init.normal_(self.emb.weight, std=0.01)
        layers, d = [], n_cat * cfg["emb_dim"] + n_num
        for h in cfg["hidden"]:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, deep_ids, wide_ids, num):
        w = self.wide(wide_ids).squeeze(1) + self.wide_bias
        d = self.deep(torch.cat([self.emb(deep_ids).flatten(1), num], dim=1)).squeeze(1)
        return w + d


@torch.no_grad()
def evaluate(model, loader, dev, n):
    model.eval()
    ps, ys = [], []
    for deep_ids, wide_ids, num, y in loader:
        ps.append(torch.sigmoid(model(deep_ids.to(dev), wide_ids.to(dev), num.to(dev))))
        ys.append(y.to(dev))
    p, y = torch.cat(ps), torch.cat(ys)
    ws = dist.get_world_size()
    gp, gy = [torch.empty_like(p) for _ in range(ws)], [torch.empty_like(y) for _ in range(ws)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    model.train()
    return roc_auc_score(y, p), float(F.binary_cross_entropy(torch.from_numpy(p).clamp(1e-7, 1 - 1e-7),
                                                              torch.from_numpy(y)))


def main():
    cfg = load_cfg()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.manual_seed(0)

    hasher = FeatureHasher(cfg["categorical"], cfg["cross_pairs"], cfg["deep_buckets"], cfg["wide_buckets"])
    train = AdLogs(cfg["train_path"], cfg, hasher)
    valid = AdLogs(cfg["valid_path"], cfg, hasher)
    sampler = DistributedSampler(train, shuffle=True)
    train_dl = DataLoader(train, batch_size=cfg["batch_size"], sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid, batch_size=8192, sampler=DistributedSampler(valid, shuffle=False),
                          num_workers=8, pin_memory=True)

    model = WideDeep(cfg).to(dev)
    model = DDP(model, device_ids=[local])
    wide_params = [model.module.wide.weight, model.module.wide_bias]
    deep_params = [p for n, p in model.module.named_parameters() if not n.startswith("wide")]
    opt_wide = torch.optim.Adagrad(wide_params, lr=cfg["lr_wide"])
    opt_deep = torch.optim.Adam(deep_params, lr=cfg["lr_deep"])

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0, tot, cnt = time.time(), 0.0, 0
        for step, (deep_ids, wide_ids, num, y) in enumerate(train_dl):
            deep_ids, wide_ids = deep_ids.to(dev, non_blocking=True), wide_ids.to(dev, non_blocking=True)
            num, y = num.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(deep_ids, wide_ids, num), y)
            opt_wide.zero_grad(set_to_none=True)
            opt_deep.zero_grad(set_to_none=True)
            loss.backward()
            opt_wide.step()
            opt_deep.step()
            tot, cnt = tot + loss.item(), cnt + 1
            if rank == 0 and step % 500 == 0:
                print(f"[{epoch}:{step}] loss {tot / cnt:.5f} {time.time() - t0:.0f}s", flush=True)
                tot, cnt = 0.0, 0

        auc, ll = evaluate(model, valid_dl, dev, len(valid))
        if rank == 0:
            print(f"epoch {epoch} valid auc={auc:.5f} logloss={ll:.5f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"model_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
