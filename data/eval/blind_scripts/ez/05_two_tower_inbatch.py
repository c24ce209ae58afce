#!/usr/bin/env python
"""Two-tower (product title <-> tag name) retrieval model for the tag catalog.

Trained with in-batch negatives gathered from all GPUs, evaluated by retrieving
over every tag for every test product (P@k / nDCG@k).

    torchrun --nproc_per_node=8 05_two_tower_inbatch.py --data /mnt/shared/tagging/catalog_v7
"""
import argparse
import math
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather as all_gather_with_grad
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="/mnt/shared/tagging/runs/two_tower")
    parser.add_argument("--hash-buckets", type=int, default=2_000_003)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=1024, help="global batch")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser


class PairDataset(Dataset):
    """(title tokens, one positive tag) pairs; the positive is re-drawn every time."""

    def __init__(self, tokens, Y):
        self.tokens, self.Y = tokens, Y
        self.rows = np.flatnonzero(np.diff(Y.indptr) > 0)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        labs = self.Y.indices[self.Y.indptr[r]:self.Y.indptr[r + 1]]
        return torch.from_numpy(self.tokens[r].astype(np.int64)), int(np.random.choice(labs))


class RowDataset(Dataset):
    def __init__(self, tokens, rows):
        self.tokens, self.rows = tokens, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return torch.from_numpy(self.tokens[r].astype(np.int64)), r


class Tower(nn.Module):
    def __init__(self, buckets, dim):
        super().__init__()
        self.emb = nn.EmbeddingBag(buckets, dim, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.ReLU(), nn.Linear(dim * 2, dim))

    def forward(self, tokens):
        return F.normalize(self.mlp(self.emb(tokens)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, buckets, dim, num_labels):
        super().__init__()
        self.query = Tower(buckets, dim)
        self.label = Tower(buckets, dim)
        self.label_id = nn.Embedding(num_labels, dim)
        nn.init.zeros_(self.label_id.weight)

    def encode_labels(self, label_tokens, label_ids):
        return F.normalize(self.label(label_tokens) + self.label_id(label_ids), dim=-1)

    def forward(self, q_tokens, label_tokens, label_ids):
        return self.query(q_tokens), self.encode_labels(label_tokens, label_ids)


@torch.no_grad()
def evaluate(net, loader, label_tokens, Y, device, ks=(1, 3, 5)):
    net.eval()
    num_labels = label_tokens.size(0)
    all_ids = torch.arange(num_labels, device=device)
    L = torch.cat([net.encode_labels(label_tokens[i:i + 65536], all_ids[i:i + 65536])
                   for i in range(0, num_labels, 65536)])
    disc = 1.0 / np.log2(np.arange(2, max(ks) + 2))
    sums = np.zeros(2 * len(ks) + 1)
    for tokens, rows in loader:
        q = net.query(tokens.to(device))
        top = (q @ L.t()).topk(max(ks), dim=1).indices.cpu().numpy()
        for r, pred in zip(rows.numpy(), top):
            true = Y.indices[Y.indptr[r]:Y.indptr[r + 1]]
            hit = np.isin(pred, true)
            for j, k in enumerate(ks):
                sums[j] += hit[:k].sum() / k
                if len(true):
                    sums[len(ks) + j] += (hit[:k] * disc[:k]).sum() / disc[:min(k, len(true))].sum()
        sums[-1] += len(rows)
    t = torch.tensor(sums, device=device, dtype=torch.float64)
    dist.all_reduce(t)
    net.train()
    t = (t[:-1] / t[-1]).tolist()
    return {**{f"P@{k}": t[j] for j, k in enumerate(ks)},
            **{f"nDCG@{k}": t[len(ks) + j] for j, k in enumerate(ks)}}


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    tr_tokens = np.load(os.path.join(args.data, "train_title_hash.npy"), mmap_mode="r")
    te_tokens = np.load(os.path.join(args.data, "test_title_hash.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(args.data, "Y_train.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data, "Y_test.npz")).tocsr()
    label_tokens_np = np.load(os.path.join(args.data, "label_name_hash.npy"))
    label_tokens = torch.from_numpy(label_tokens_np.astype(np.int64)).to(device)
    num_labels = label_tokens.size(0)

    train_ds = PairDataset(tr_tokens, Y_tr)
    test_ds = RowDataset(te_tokens, np.arange(rank, te_tokens.shape[0], world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    per_gpu = args.batch_size // world
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, drop_last=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=1024, num_workers=2)

    net = TwoTower(args.hash_buckets, args.dim, num_labels).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (tokens, pos) in enumerate(train_loader):
            tokens = tokens.to(device, non_blocking=True)
            pos = pos.to(device, non_blocking=True)
            q, l = model(tokens, label_tokens[pos], pos)
            all_l = torch.cat(all_gather_with_grad(l), dim=0)            # [world * B, d]
            pos_list = [torch.empty_like(pos) for _ in range(world)]
            dist.all_gather(pos_list, pos)
            all_pos = torch.cat(pos_list, dim=0)
            logits = q @ all_l.t() / args.temperature
            target = torch.arange(q.size(0), device=device) + rank * q.size(0)
            same_tag = all_pos.unsqueeze(0) == pos.unsqueeze(1)
            same_tag[torch.arange(q.size(0), device=device), target] = False
            logits = logits.masked_fill(same_tag, float("-inf"))
            loss = F.cross_entropy(logits, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        metrics = evaluate(net, test_loader, label_tokens, Y_te, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
