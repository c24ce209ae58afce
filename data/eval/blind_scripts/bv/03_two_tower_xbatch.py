"""Two-tower retrieval with cross-rank in-batch negatives.

Every rank's item embeddings are all-gathered so a user on rank r is scored
against world_size * batch_size candidates. Gradients flow back through the
gather (GatherLayer) to the rank that produced each embedding.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 03_two_tower_xbatch.py --config cfg/tt_xbatch.yaml
"""
import argparse
import os
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pyarrow.dataset as pads
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    train_glob: str = "/mnt/shared/retrieval/train"
    valid_glob: str = "/mnt/shared/retrieval/valid"
    corpus: str = "/mnt/shared/retrieval/items.parquet"
    num_users: int = 10_000_000
    num_items: int = 2_000_000
    dim: int = 96
    tau: float = 0.07
    batch_size: int = 1024  # per rank
    lr: float = 1e-3  # tuned for 2 nodes x 8 GPUs (16k candidates per step)
    weight_decay: float = 0.0
    epochs: int = 4
    topk: List[int] = field(default_factory=lambda: [20, 100])
    out_dir: str = "/mnt/shared/ckpt/tt_xbatch"
    resume: str = ""


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    if a.resume:
        cfg.resume = a.resume
    return cfg


class PairData(Dataset):
    def __init__(self, path):
        tbl = pads.dataset(path, format="parquet").to_table(columns=["user_id", "item_id"])
        self.u = tbl.column("user_id").to_numpy().astype(np.int64)
        self.i = tbl.column("item_id").to_numpy().astype(np.int64)

    def __len__(self):
        return len(self.u)

    def __getitem__(self, k):
        return self.u[k], self.i[k]


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the graph: backward sums the grads of every rank
    and hands each rank the slice for its own input."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        g = torch.stack(grads)
        dist.all_reduce(g)
        return g[dist.get_rank()]


class Tower(nn.Module):
    def __init__(self, n, dim):
        super().__init__()
        self.emb = nn.Embedding(n, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, ids):
        return F.normalize(self.mlp(self.emb(ids)), dim=-1)


class DualEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.user_tower = Tower(cfg.num_users, cfg.dim)
        self.item_tower = Tower(cfg.num_items, cfg.dim)

    def forward(self, users, items):
        return self.user_tower(users), self.item_tower(items)


def xbatch_loss(u, v, items, tau, rank):
    v_all = torch.cat(GatherLayer.apply(v), dim=0)
    ids_all = [torch.empty_like(items) for _ in range(dist.get_world_size())]
    dist.all_gather(ids_all, items)
    ids_all = torch.cat(ids_all)
    logits = u @ v_all.T / tau
    target = torch.arange(u.size(0), device=u.device) + rank * u.size(0)
    # the positive item may also show up elsewhere in the global batch
    same = items.unsqueeze(1) == ids_all.unsqueeze(0)
    same[torch.arange(u.size(0), device=u.device), target] = False
    logits = logits.masked_fill(same, float("-inf"))
    return F.cross_entropy(logits, target)


@torch.no_grad()
def evaluate(model, loader, corpus_ids, topk, device):
    enc = model.module
    enc.eval()
    corpus = torch.cat([enc.item_tower(corpus_ids[s:s + 50000]) for s in range(0, len(corpus_ids), 50000)])
    kmax = max(topk)
    stats = torch.zeros(len(topk) + 1, dtype=torch.float64, device=device)
    for users, items in loader:
        users, items = users.to(device), items.to(device)
        top = (enc.user_tower(users) @ corpus.T).topk(kmax, dim=1).indices
        hit = corpus_ids[top] == items.unsqueeze(1)
        for j, k in enumerate(topk):
            stats[j] += hit[:, :k].any(dim=1).sum()
        stats[-1] += users.size(0)
    dist.all_reduce(stats)
    enc.train()
    return {f"recall@{k}": (stats[j] / stats[-1]).item() for j, k in enumerate(topk)}


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    train = PairData(cfg.train_glob)
    valid = PairData(cfg.valid_glob)
    corpus_ids = torch.from_numpy(
        pads.dataset(cfg.corpus, format="parquet").to_table(columns=["item_id"])
        .column("item_id").to_numpy().astype(np.int64)).to(device)

    # every rank must contribute exactly batch_size rows to the gather
    tr_sampler = DistributedSampler(train, shuffle=True, seed=17, drop_last=True)
    tr_loader = DataLoader(train, batch_size=cfg.batch_size, sampler=tr_sampler, drop_last=True,
                           num_workers=6, pin_memory=True, persistent_workers=True)
    va_loader = DataLoader(valid, batch_size=256, sampler=DistributedSampler(valid, shuffle=False, drop_last=True),
                           num_workers=4, pin_memory=True)

    model = DualEncoder(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start_epoch = 0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1
        del ckpt
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    if is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"world={world} global batch={cfg.batch_size * world} steps/epoch={len(tr_loader)}", flush=True)

    for epoch in range(start_epoch, cfg.epochs):
        tr_sampler.set_epoch(epoch)
        t0, seen = time.time(), 0
        for step, (users, items) in enumerate(tr_loader):
            users = users.to(device, non_blocking=True)
            items = items.to(device, non_blocking=True)
            u, v = model(users, items)
            loss = xbatch_loss(u, v, items, cfg.tau, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += users.size(0) * world
            if is_main and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} {seen / (time.time() - t0):.0f} ex/s", flush=True)

        metrics = evaluate(model, va_loader, corpus_ids, cfg.topk, device)
        if is_main:
            print(f"ep {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            tmp = os.path.join(cfg.out_dir, "last.pt.tmp")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "metrics": metrics}, tmp)
            os.replace(tmp, os.path.join(cfg.out_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
