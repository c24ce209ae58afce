"""Two-tower retrieval trained directly from impression logs.

Each impression row carries the request context (user, query-less context
features) and the shown item. Clicked rows become (user, item) positive pairs;
the negatives are the items clicked by the other requests in the global batch
(gathered from all ranks), so more GPUs = more negatives per query.

    torchrun --nproc_per_node=8 06_two_tower_click_pairs.py --cfg cfg/tt_clicks.json
"""
import argparse
import glob
import json
import os
import random
import time
from dataclasses import dataclass, asdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather as all_gather_with_grad
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


@dataclass
class TrainConfig:
    impressions: str = "/mnt/shared/impr/parquet"
    eval_pairs: str = "/mnt/shared/impr/eval_pairs.parquet"
    corpus: str = "/mnt/shared/impr/items.parquet"
    out_dir: str = "/mnt/shared/impr/runs/tt"
    n_users: int = 3_000_000
    n_items: int = 600_000
    n_ctx: int = 4096
    dim: int = 96
    batch: int = 8192
    lr: float = 5e-4
    tau: float = 0.07
    epochs: int = 2
    recall_k: int = 50
    seed: int = 2024


class Impressions(Dataset):
    def __init__(self, files):
        df = pd.concat((pd.read_parquet(f, columns=["user_id", "ctx_id", "item_id", "clicked"]) for f in files),
                       ignore_index=True)
        self.arr = df[["user_id", "ctx_id", "item_id", "clicked"]].to_numpy(np.int64)

    def __len__(self):
        return len(self.arr)

    def __getitem__(self, i):
        return self.arr[i]


class TwoTower(nn.Module):
    def __init__(self, c: TrainConfig):
        super().__init__()
        self.user = nn.Embedding(c.n_users, c.dim)
        self.ctx = nn.Embedding(c.n_ctx, c.dim)
        self.item = nn.Embedding(c.n_items, c.dim)
        self.q_mlp = nn.Sequential(nn.Linear(2 * c.dim, 256), nn.ReLU(), nn.Linear(256, c.dim))
        self.i_mlp = nn.Sequential(nn.Linear(c.dim, 256), nn.ReLU(), nn.Linear(256, c.dim))
        for e in (self.user, self.ctx, self.item):
            nn.init.normal_(e.weight, std=0.02)

    def query(self, user, ctx):
        return F.normalize(self.q_mlp(torch.cat([self.user(user), self.ctx(ctx)], -1)), dim=-1)

    def candidate(self, item):
        return F.normalize(self.i_mlp(self.item(item)), dim=-1)

    def forward(self, user, ctx, item):
        return self.query(user, ctx), self.candidate(item)


def contrastive_loss(q, c, tau, rank):
    all_c = torch.cat(all_gather_with_grad(c), 0)
    logits = q @ all_c.t() / tau
    offset = rank * q.size(0)
    labels = torch.arange(q.size(0), device=q.device) + offset
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def eval_recall(net, cfg, device, rank, world):
    net.eval()
    items = torch.from_numpy(pd.read_parquet(cfg.corpus, columns=["item_id"])["item_id"].to_numpy(np.int64))
    items = items.to(device)
    cand = torch.cat([net.candidate(items[i:i + 65536]) for i in range(0, items.numel(), 65536)])
    pairs = pd.read_parquet(cfg.eval_pairs, columns=["user_id", "ctx_id", "item_id"]).to_numpy(np.int64)
    pairs = torch.from_numpy(pairs[rank::world])
    hit = torch.zeros(2, device=device)
    for i in range(0, len(pairs), 4096):
        b = pairs[i:i + 4096].to(device)
        q = net.query(b[:, 0], b[:, 1])
        topk = (q @ cand.t()).topk(cfg.recall_k, -1).indices
        hit[0] += (items[topk] == b[:, 2:3]).any(-1).sum()
        hit[1] += b.size(0)
    dist.all_reduce(hit)
    net.train()
    return (hit[0] / hit[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cfg", default=None)
    a = p.parse_args()
    cfg = TrainConfig()
    if a.cfg:
        with open(a.cfg) as f:
            cfg = TrainConfig(**{**asdict(cfg), **json.load(f)})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    files = sorted(glob.glob(os.path.join(cfg.impressions, "*.parquet")))
    ds = Impressions(files)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(TwoTower(cfg).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        print(f"{len(ds):,} impressions, {len(loader)} steps/epoch/rank, world={world}", flush=True)

    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t = time.time()
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            pos = batch[batch[:, 3] == 1]
            q, c = model(pos[:, 0], pos[:, 1], pos[:, 2])
            loss = contrastive_loss(q, c, cfg.tau, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                stats = torch.stack([loss.detach(), torch.tensor(float(pos.size(0)), device=device)])
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {stats[0].item() / world:.4f} "
                          f"pos/step {stats[1].item():.0f} {100 / (time.time() - t):.2f} it/s", flush=True)
                t = time.time()

        r = eval_recall(model.module, cfg, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} recall@{cfg.recall_k} = {r:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "recall": r},
                       os.path.join(cfg.out_dir, f"tt_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
