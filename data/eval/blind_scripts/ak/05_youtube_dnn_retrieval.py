#!/usr/bin/env python
"""YouTube-DNN style candidate generation with sampled softmax, 4-GPU DDP.

Features: watch history (mean-pooled), search tokens (hash-bucketed), user
geo/device categorical features. Trained with sampled softmax over the item
vocabulary (log-uniform sampler, shared negatives per batch).

    torchrun --nproc_per_node=4 05_youtube_dnn_retrieval.py --config configs/ytdnn.yaml
"""
import argparse
import math
import os
import time
import zlib

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

DEFAULTS = dict(
    train_path="data/watch_train.parquet",
    val_path="data/watch_val.parquet",
    num_items=500_000,
    search_buckets=200_000,
    num_geo=300,
    num_device=16,
    dim=128,
    hist_len=64,
    search_len=16,
    num_sampled=8192,
    batch_size=2048,
    lr=2e-3,
    epochs=4,
    topk=50,
    out_dir="ckpt/ytdnn",
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[])
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.override:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v)
    return argparse.Namespace(**cfg)


def bucket(token, n):
    return zlib.crc32(token.encode()) % n + 1


class WatchData(Dataset):
    def __init__(self, path, cfg):
        t = pq.read_table(path).to_pandas()
        self.hist = t["hist"].values
        self.search = t["search"].values
        self.geo = t["geo"].values.astype(np.int64)
        self.devtype = t["device"].values.astype(np.int64)
        self.target = t["target"].values.astype(np.int64)
        self.cfg = cfg

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        c = self.cfg
        h = list(self.hist[i][-c.hist_len:])
        h = h + [0] * (c.hist_len - len(h))
        s = [bucket(tok, c.search_buckets) for tok in self.search[i][: c.search_len]]
        s = s + [0] * (c.search_len - len(s))
        return (torch.tensor(h), torch.tensor(s), torch.tensor(self.geo[i]),
                torch.tensor(self.devtype[i]), torch.tensor(self.target[i]))


class CandidateGen(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.dim
        self.item_in = nn.Embedding(cfg.num_items + 1, d, padding_idx=0)
        self.search = nn.Embedding(cfg.search_buckets + 1, d, padding_idx=0)
        self.geo = nn.Embedding(cfg.num_geo, 16)
        self.device_emb = nn.Embedding(cfg.num_device, 8)
        self.tower = nn.Sequential(
            nn.Linear(2 * d + 24, 1024), nn.ReLU(),
            nn.Linear(1024, 512), nn.ReLU(),
            nn.Linear(512, d),
        )
        # output softmax weights (item "out" embeddings) and bias
        self.item_out = nn.Embedding(cfg.num_items + 1, d)
        self.item_bias = nn.Embedding(cfg.num_items + 1, 1)
        nn.init.zeros_(self.item_bias.weight)

    @staticmethod
    def _pool(emb, ids):
        m = (ids > 0).float().unsqueeze(-1)
        return (emb(ids) * m).sum(1) / m.sum(1).clamp(min=1.0)

    def user_vec(self, hist, search, geo, dev):
        x = torch.cat([self._pool(self.item_in, hist), self._pool(self.search, search),
                       self.geo(geo), self.device_emb(dev)], dim=-1)
        return self.tower(x)

    def forward(self, hist, search, geo, dev, target, sampled, log_q_sampled, log_q_target):
        u = self.user_vec(hist, search, geo, dev)
        true_logit = (u * self.item_out(target)).sum(-1) + self.item_bias(target).squeeze(-1)
        samp_logit = u @ self.item_out(sampled).t() + self.item_bias(sampled).squeeze(-1)
        samp_logit = samp_logit - log_q_sampled
        samp_logit = samp_logit.masked_fill(sampled.unsqueeze(0) == target.unsqueeze(1), -1e9)
        logits = torch.cat([(true_logit - log_q_target).unsqueeze(1), samp_logit], dim=1)
        return F.cross_entropy(logits, torch.zeros_like(target))


class LogUniformSampler:
    def __init__(self, n, device):
        self.n = n
        r = torch.arange(1, n + 1, dtype=torch.float64, device=device)
        self.probs = ((r + 1).log() - r.log()) / math.log(n + 1)

    def sample(self, k, gen):
        ids = torch.multinomial(self.probs.float(), k, replacement=True, generator=gen) + 1
        return ids, self.log_q(ids, k)

    def log_q(self, ids, k):
        return torch.log(self.probs[ids - 1].float() * k)


@torch.no_grad()
def recall_at_k(model, loader, cfg, device):
    net = model.module
    net.eval()
    w = net.item_out.weight[1:]
    b = net.item_bias.weight[1:, 0]
    hits = torch.zeros(2, device=device)
    for hist, search, geo, dev, target in loader:
        u = net.user_vec(hist.to(device), search.to(device), geo.to(device), dev.to(device))
        top = (u @ w.t() + b).topk(cfg.topk, dim=1).indices + 1
        hits[0] += (top == target.to(device).unsqueeze(1)).any(1).sum()
        hits[1] += target.numel()
    dist.all_reduce(hits)
    net.train()
    return (hits[0] / hits[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    train_ds = WatchData(cfg.train_path, cfg)
    val_ds = WatchData(cfg.val_path, cfg)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True,
                              num_workers=8, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_part = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_part, batch_size=4096, num_workers=4, pin_memory=True)

    model = CandidateGen(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg.lr)
    sampler = LogUniformSampler(cfg.num_items, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(7 + rank)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"train rows {len(train_ds)}, steps/epoch {len(train_loader)}", flush=True)

    step = 0
    for epoch in range(cfg.epochs):
        t0 = time.time()
        for hist, search, geo, dev, target in train_loader:
            hist, search = hist.to(device, non_blocking=True), search.to(device, non_blocking=True)
            geo, dev = geo.to(device, non_blocking=True), dev.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            sampled, lq_s = sampler.sample(cfg.num_sampled, gen)
            lq_t = sampler.log_q(target, cfg.num_sampled)
            loss = model(hist, search, geo, dev, target, sampled, lq_s, lq_t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 500 == 0:
                ips = 500 * cfg.batch_size * world / (time.time() - t0)
                print(f"ep {epoch} step {step} loss {loss.item():.4f} {ips:.0f} ex/s", flush=True)
                t0 = time.time()

        r = recall_at_k(model, val_loader, cfg, device)
        if rank == 0:
            print(f"epoch {epoch} recall@{cfg.topk} {r:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "cfg": vars(cfg)},
                       os.path.join(cfg.out_dir, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
