#!/usr/bin/env python3
# Train a DLRM-style model directly from the raw Criteo Kaggle day files (TSV).
# The first run converts the TSV into hashed int32/float32 arrays under --cache_dir
# so later runs start in seconds.
#
# torchrun --nnodes 1 --nproc_per_node 4 06_criteo_tsv_cache.py --raw /data/criteo/train.txt
import argparse
import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_DENSE, N_CAT = 13, 26


def hash_token(tok, col, buckets):
    if not tok:
        return 0
    h = hashlib.md5(f"{col}:{tok}".encode()).digest()
    return 1 + int.from_bytes(h[:8], "little") % (buckets - 1)


def preprocess(raw_path, cache_dir, buckets, max_rows=None):
    dense, cats, labels = [], [], []
    with open(raw_path) as f:
        for n, line in enumerate(f):
            if max_rows and n >= max_rows:
                break
            parts = line.rstrip("\n").split("\t")
            labels.append(int(parts[0]))
            dense.append([float(x) if x else 0.0 for x in parts[1:1 + N_DENSE]])
            cats.append([hash_token(x, c, buckets) for c, x in enumerate(parts[1 + N_DENSE:])])
    os.makedirs(cache_dir, exist_ok=True)
    np.save(os.path.join(cache_dir, "dense.npy"), np.log1p(np.maximum(np.asarray(dense, np.float32), 0)))
    np.save(os.path.join(cache_dir, "cats.npy"), np.asarray(cats, np.int32))
    np.save(os.path.join(cache_dir, "labels.npy"), np.asarray(labels, np.float32))
    with open(os.path.join(cache_dir, "meta.json"), "w") as f:
        json.dump({"rows": len(labels), "buckets": buckets, "source": raw_path}, f)


class CachedCriteo(Dataset):
    def __init__(self, cache_dir):
        self.dense = np.load(os.path.join(cache_dir, "dense.npy"), mmap_mode="r")
        self.cats = np.load(os.path.join(cache_dir, "cats.npy"), mmap_mode="r")
        self.labels = np.load(os.path.join(cache_dir, "labels.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return (torch.from_numpy(np.array(self.dense[i])),
                torch.from_numpy(np.array(self.cats[i], dtype=np.int64)),
                torch.tensor(self.labels[i]))


class DotInteractionNet(nn.Module):
    def __init__(self, buckets, d=16, bot=(512, 256), top=(512, 256)):
        super().__init__()
        dims = [N_DENSE, *bot, d]
        self.bot = nn.Sequential(*[m for a, b in zip(dims[:-1], dims[1:])
                                   for m in (nn.Linear(a, b), nn.ReLU())])
        self.emb = nn.Embedding(N_CAT * buckets, d)
        self.register_buffer("field_offset", torch.arange(N_CAT) * buckets, persistent=False)
        f = N_CAT + 1
        tdims = [d + f * (f - 1) // 2, *top]
        layers = [m for a, b in zip(tdims[:-1], tdims[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
        self.top = nn.Sequential(*layers, nn.Linear(tdims[-1], 1))

    def forward(self, dense, cats):
        x = self.bot(dense)
        e = self.emb(cats + self.field_offset)
        t = torch.cat([x.unsqueeze(1), e], 1)
        z = t @ t.transpose(1, 2)
        i, j = torch.tril_indices(t.shape[1], t.shape[1], -1, device=t.device)
        return self.top(torch.cat([x, z[:, i, j]], 1)).squeeze(1)


@torch.no_grad()
def run_eval(net, loader, device):
    net.eval()
    nb = 4096
    acc = torch.zeros(2 * nb + 2, dtype=torch.float64, device=device)
    for dense, cats, y in loader:
        dense, cats, y = dense.to(device), cats.to(device), y.to(device)
        logit = net(dense, cats)
        acc[-2] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        acc[-1] += y.numel()
        b = (torch.sigmoid(logit) * nb).long().clamp_(max=nb - 1)
        acc[:nb] += torch.bincount(b, weights=y.double(), minlength=nb)
        acc[nb:2 * nb] += torch.bincount(b, weights=1 - y.double(), minlength=nb)
    dist.all_reduce(acc)
    pos, neg = acc[:nb], acc[nb:2 * nb]
    auc = ((pos * (neg.cumsum(0) - neg + 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    net.train()
    return (acc[-2] / acc[-1]).item(), auc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", default="/data/criteo/train.txt")
    ap.add_argument("--cache_dir", default="/data/criteo/cache_h250k")
    ap.add_argument("--buckets", type=int, default=250_000)
    ap.add_argument("--valid_frac", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save", default="/data/criteo/runs/dot_h250k.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    if not os.path.exists(os.path.join(args.cache_dir, "meta.json")):
        t0 = time.time()
        preprocess(args.raw, args.cache_dir, args.buckets)
        print(f"[rank {rank}] built cache in {time.time() - t0:.0f}s", flush=True)
    data = CachedCriteo(args.cache_dir)

    # Criteo Kaggle is time ordered: hold out the tail as validation
    n_valid = int(len(data) * args.valid_frac)
    train = Subset(data, range(0, len(data) - n_valid))
    valid = Subset(data, range(len(data) - n_valid, len(data)))
    valid_part = Subset(valid, range(rank, len(valid), world))
    sampler = DistributedSampler(train, shuffle=True, seed=7, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_part, batch_size=16384, num_workers=4, pin_memory=True)

    torch.manual_seed(7)
    net = DotInteractionNet(args.buckets).to(dev)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen, loss_sum, t0 = 0, 0.0, time.time()
        for it, (dense, cats, y) in enumerate(train_dl):
            dense, cats, y = dense.to(dev, non_blocking=True), cats.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(dense, cats), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            seen += 1
            if rank == 0 and it % 500 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss_sum / seen:.4f} "
                      f"{seen * args.batch * world / (time.time() - t0):.0f} ex/s", flush=True)
        ll, auc = run_eval(model.module, valid_dl, dev)
        if rank == 0:
            print(f"== epoch {epoch}: valid logloss {ll:.5f} auc {auc:.5f}", flush=True)
            os.makedirs(os.path.dirname(args.save), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc,
                        "buckets": args.buckets}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
