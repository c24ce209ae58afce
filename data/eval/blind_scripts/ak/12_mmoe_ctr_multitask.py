#!/usr/bin/env python
"""MMoE multi-task ranking model (click / like / finish) on short-video logs.

Sparse features are hashed into per-field buckets; experts are shared, each task
has its own gate and tower. The model always carries all three heads so that
checkpoints stay interchangeable between experiments that train on a subset of
the tasks (--tasks).

    torchrun --nproc_per_node=8 12_mmoe_ctr_multitask.py --data /data/kuaivideo \
        --tasks click,like --epochs 2
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TASKS = ["click", "like", "finish"]
SPARSE_FIELDS = ["user_id", "item_id", "author_id", "music_id", "city", "device",
                 "hour", "channel", "item_tag"]
BUCKETS = {"user_id": 2_000_000, "item_id": 4_000_000, "author_id": 500_000,
           "music_id": 200_000, "city": 1000, "device": 5000, "hour": 24,
           "channel": 16, "item_tag": 10_000}
NUM_DENSE = 8


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--tasks", default="click,like")
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt", default="ckpt/mmoe.pt")
    return p.parse_args()


class Impressions(Dataset):
    def __init__(self, files):
        tables = [pq.read_table(f).to_pandas() for f in files]
        df = pd.concat(tables, ignore_index=True)
        self.sparse = np.stack([df[f].values.astype(np.int64) % BUCKETS[f]
                                for f in SPARSE_FIELDS], axis=1)
        self.dense = df[[f"d{i}" for i in range(NUM_DENSE)]].values.astype(np.float32)
        self.labels = df[TASKS].values.astype(np.float32)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.labels[i]


class MMoE(nn.Module):
    def __init__(self, emb_dim, n_experts, expert_dim):
        super().__init__()
        self.embs = nn.ModuleDict({f: nn.Embedding(BUCKETS[f], emb_dim) for f in SPARSE_FIELDS})
        in_dim = emb_dim * len(SPARSE_FIELDS) + NUM_DENSE
        self.dense_bn = nn.BatchNorm1d(NUM_DENSE)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU(), nn.Linear(512, expert_dim), nn.ReLU())
            for _ in range(n_experts)])
        self.gates = nn.ModuleDict({t: nn.Linear(in_dim, n_experts) for t in TASKS})
        self.towers = nn.ModuleDict({
            t: nn.Sequential(nn.Linear(expert_dim, 128), nn.ReLU(), nn.Linear(128, 1))
            for t in TASKS})

    def forward(self, sparse, dense):
        e = [self.embs[f](sparse[:, j]) for j, f in enumerate(SPARSE_FIELDS)]
        x = torch.cat(e + [self.dense_bn(dense)], dim=1)
        expert_out = torch.stack([ex(x) for ex in self.experts], dim=1)  # B, E, D
        out = {}
        for t in TASKS:
            w = torch.softmax(self.gates[t](x), dim=-1).unsqueeze(-1)
            out[t] = self.towers[t]((w * expert_out).sum(1)).squeeze(-1)
        return out


@torch.no_grad()
def evaluate(model, loader, device, tasks):
    net = model.module
    net.eval()
    preds = {t: [] for t in tasks}
    labels = {t: [] for t in tasks}
    for sparse, dense, y in loader:
        out = net(sparse.to(device), dense.to(device))
        for t in tasks:
            preds[t].append(torch.sigmoid(out[t]).cpu())
            labels[t].append(y[:, TASKS.index(t)])
    local = {t: (torch.cat(preds[t]), torch.cat(labels[t])) for t in tasks}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    net.train()
    aucs = {}
    for t in tasks:
        p = torch.cat([g[t][0] for g in gathered]).numpy()
        l = torch.cat([g[t][1] for g in gathered]).numpy()
        aucs[t] = roc_auc_score(l, p)
    return aucs


def main():
    args = cli()
    tasks = args.tasks.split(",")
    assert all(t in TASKS for t in tasks), tasks
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    files = sorted(glob.glob(os.path.join(args.data, "day=*", "*.parquet")))
    train_files, val_files = files[:-4], files[-4:]
    train_ds = Impressions(train_files)
    val_ds = Impressions(val_files)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=2024, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=16384, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(
        MMoE(args.emb_dim, args.experts, args.expert_dim)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    task_w = {"click": 1.0, "like": 2.0, "finish": 1.0}

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (sparse, dense, y) in enumerate(train_loader):
            sparse = sparse.to(device, non_blocking=True)
            dense = dense.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            out = model(sparse, dense)
            loss = sum(task_w[t] * F.binary_cross_entropy_with_logits(out[t], y[:, TASKS.index(t)])
                       for t in tasks)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if it % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it} loss {l.item():.4f} "
                          f"({(time.time() - t0) / (it + 1) * 1000:.0f} ms/it)", flush=True)

        aucs = evaluate(model, val_loader, device, tasks)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{t}_auc={a:.4f}" for t, a in aucs.items()), flush=True)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "tasks": tasks, "epoch": epoch}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
