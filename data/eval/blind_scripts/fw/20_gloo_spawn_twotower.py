#!/usr/bin/env python
"""Two-tower retrieval model (user history -> next item) trained on CPU nodes with gloo.

Each node runs this launcher, which spawns --nproc-per-node workers. Interaction logs
are day-partitioned parquet files on NFS; every worker reads its own subset of files,
so workers see different numbers of batches per epoch.

    # on every node (node-rank 0..3)
    python 20_gloo_spawn_twotower.py --nnodes 4 --node-rank $NODE_RANK --nproc-per-node 8 \
        --master-addr cpu-b01 --logs /nfs/recsys/logs --work /nfs/recsys/runs/twotower
"""
import argparse
import glob
import json
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=8)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29577)
    p.add_argument("--logs", required=True)
    p.add_argument("--work", required=True, help="shared (NFS) output folder")
    p.add_argument("--hist-len", type=int, default=50)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3, help="lr at a global batch of 4096")
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--threads", type=int, default=6)
    return p.parse_args()


def build_vocab(files, path):
    items = set()
    for f in files:
        items.update(pd.read_parquet(f, columns=["item_id"])["item_id"].unique().tolist())
    vocab = {str(it): i + 1 for i, it in enumerate(sorted(items))}  # 0 = padding
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(vocab, fh)
    os.replace(tmp, path)


class HistoryDataset(Dataset):
    def __init__(self, files, vocab, hist_len):
        rows = []
        for f in files:
            df = pd.read_parquet(f, columns=["user_id", "item_id", "ts"]).sort_values(["user_id", "ts"])
            for _, g in df.groupby("user_id"):
                ids = [vocab.get(str(i), 0) for i in g["item_id"].tolist()]
                for t in range(1, len(ids)):
                    hist = ids[max(0, t - hist_len):t]
                    rows.append((hist + [0] * (hist_len - len(hist)), ids[t]))
        self.hist = torch.tensor([r[0] for r in rows], dtype=torch.long)
        self.target = torch.tensor([r[1] for r in rows], dtype=torch.long)

    def __len__(self):
        return self.target.numel()

    def __getitem__(self, i):
        return self.hist[i], self.target[i]


class TwoTower(nn.Module):
    def __init__(self, n_items, dim):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=0)
        self.user_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.item_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, hist, target):
        mask = (hist > 0).unsqueeze(-1).float()
        pooled = (self.item_emb(hist) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        u = F.normalize(self.user_mlp(pooled), dim=-1)
        v = F.normalize(self.item_mlp(self.item_emb(target)), dim=-1)
        return u, v


def worker(local_rank, args):
    rank = args.node_rank * args.nproc_per_node + local_rank
    world_size = args.nnodes * args.nproc_per_node
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    files = sorted(glob.glob(os.path.join(args.logs, "day=*", "*.parquet")))
    train_files, val_files = files[:-1], files[-1:]
    assert len(train_files) >= world_size, f"{len(train_files)} training files for {world_size} workers"
    vocab_path = os.path.join(args.work, "item_vocab.json")
    if rank == 0:
        os.makedirs(args.work, exist_ok=True)
        if not os.path.exists(vocab_path):
            build_vocab(files, vocab_path)
    dist.barrier()  # vocab is on NFS and complete once rank 0 passes this point
    with open(vocab_path) as fh:
        vocab = json.load(fh)

    # file-level sharding; shards differ in size, Join below handles the uneven ends
    my_files = train_files[rank::world_size]
    train_ds = HistoryDataset(my_files, vocab, args.hist_len)
    val_ds = HistoryDataset(val_files, vocab, args.hist_len)
    val_idx = list(range(rank, len(val_ds), world_size))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=2)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1024)

    torch.manual_seed(0)
    model = DDP(TwoTower(len(vocab) + 1, args.dim))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * math.sqrt(args.batch_size * world_size / 4096))
    print(f"[rank {rank}] {len(my_files)} files, {len(train_ds)} examples, {len(train_dl)} batches", flush=True)

    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        n_batches, loss_sum = 0, 0.0
        with Join([model]):
            for hist, target in train_dl:
                u, v = model(hist, target)
                logits = u @ v.t() / args.temperature  # in-batch negatives
                loss = F.cross_entropy(logits, torch.arange(len(target)))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.item()
                n_batches += 1

        # recall@50 on the last day against the full item table
        model.eval()
        stats = torch.zeros(3, dtype=torch.float64)  # hits, n, train_loss_sum
        with torch.no_grad():
            net = model.module
            item_table = F.normalize(net.item_mlp(net.item_emb.weight[1:]), dim=-1)
            for hist, target in val_dl:
                u, _ = net(hist, target)
                top = (u @ item_table.t()).topk(50, dim=1).indices + 1
                stats[0] += (top == target.unsqueeze(1)).any(1).sum().item()
                stats[1] += target.numel()
        stats[2] = loss_sum / max(n_batches, 1)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: train_loss {stats[2].item() / world_size:.4f} "
                  f"recall@50 {stats[0].item() / stats[1].item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "n_items": len(vocab) + 1},
                       os.path.join(args.work, f"twotower_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.nproc_per_node, join=True)
