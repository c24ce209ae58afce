"""
Click-through-rate model (DCN-v2 style) trained on daily parquet shards.

Each rank streams its own subset of the parquet files (no random access, so no
DistributedSampler), gradients are averaged with all_reduce after backward.

  torchrun --nproc_per_node=8 09_ctr_parquet_shards.py \
      --train-glob '/data/ctr/train/day=*/part-*.parquet' \
      --valid-glob '/data/ctr/valid/part-*.parquet'
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

DENSE = [f"i{i}" for i in range(1, 14)]
SPARSE = [f"c{i}" for i in range(1, 27)]
HASH_BUCKETS = 1_000_003


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train-glob", required=True)
    p.add_argument("--valid-glob", required=True)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--mlp", default="512,256,128")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save", default="ckpt/dcn.pt")
    return p.parse_args()


class ParquetStream(IterableDataset):
    def __init__(self, files, batch_size, shuffle_rows=True, seed=0):
        self.files = files
        self.batch_size = batch_size
        self.shuffle_rows = shuffle_rows
        self.seed = seed
        self.epoch = 0

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        rng = np.random.default_rng(self.seed + self.epoch)
        for path in files:
            pf = pq.ParquetFile(path)
            for rg in range(pf.num_row_groups):
                tbl = pf.read_row_group(rg, columns=DENSE + SPARSE + ["label"]).to_pandas()
                if self.shuffle_rows:
                    tbl = tbl.sample(frac=1.0, random_state=int(rng.integers(1 << 31)))
                dense = np.log1p(tbl[DENSE].fillna(0).clip(lower=0).to_numpy(np.float32))
                sparse = tbl[SPARSE].fillna(0).to_numpy(np.int64) % HASH_BUCKETS
                label = tbl["label"].to_numpy(np.float32)
                for s in range(0, len(tbl) - self.batch_size + 1, self.batch_size):
                    e = s + self.batch_size
                    yield (torch.from_numpy(dense[s:e]), torch.from_numpy(sparse[s:e]),
                           torch.from_numpy(label[s:e]))


class CrossNet(nn.Module):
    def __init__(self, dim, n):
        super().__init__()
        self.w = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCN(nn.Module):
    def __init__(self, emb_dim, n_cross, mlp_dims):
        super().__init__()
        self.emb = nn.EmbeddingBag(HASH_BUCKETS, emb_dim, mode="sum")
        d = len(DENSE) + len(SPARSE) * emb_dim
        self.cross = CrossNet(d, n_cross)
        layers, prev = [], d
        for h in mlp_dims:
            layers += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(d + prev, 1)

    def forward(self, dense, sparse):
        b = sparse.size(0)
        e = self.emb(sparse.reshape(-1, 1)).view(b, -1)
        x0 = torch.cat([dense, e], dim=1)
        return self.out(torch.cat([self.cross(x0), self.deep(x0)], dim=1)).squeeze(1)


def average_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for dense, sparse, y in loader:
        dense, sparse, y = dense.to(device), sparse.to(device), y.to(device)
        s[0] += F.binary_cross_entropy_with_logits(model(dense, sparse), y, reduction="sum")
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    train_files = sorted(glob.glob(args.train_glob))
    valid_files = sorted(glob.glob(args.valid_glob))
    my_train = train_files[rank::world]
    my_valid = valid_files[rank::world]
    if rank == 0:
        print(f"{len(train_files)} train files, {len(valid_files)} valid files, {world} ranks", flush=True)

    train_ds = ParquetStream(my_train, args.batch_size, shuffle_rows=True, seed=rank)
    train_dl = DataLoader(train_ds, batch_size=None, num_workers=4, pin_memory=True, prefetch_factor=4)
    valid_dl = DataLoader(ParquetStream(my_valid, 8192, shuffle_rows=False), batch_size=None,
                          num_workers=2, pin_memory=True)

    model = DCN(args.emb_dim, args.cross_layers, [int(x) for x in args.mlp.split(",")]).to(dev)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
    opt = torch.optim.Adam([{"params": dense_params},
                            {"params": model.emb.parameters(), "lr": args.lr * 10}], lr=args.lr)

    best = math.inf
    for epoch in range(args.epochs):
        train_ds.epoch = epoch
        model.train()
        t0, n, run = time.time(), 0, 0.0
        for dense, sparse, y in train_dl:
            dense = dense.to(dev, non_blocking=True)
            sparse = sparse.to(dev, non_blocking=True)
            y = y.to(dev, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            average_grads(model, world)
            opt.step()
            n += 1
            run += loss.item()
            if rank == 0 and n % 500 == 0:
                print(f"epoch {epoch} batch {n} logloss {run / 500:.5f} "
                      f"{n * args.batch_size * world / (time.time() - t0):.0f} ex/s", flush=True)
                run = 0.0

        val = evaluate(model, valid_dl, dev)
        if rank == 0:
            print(f"epoch {epoch} valid logloss {val:.5f}", flush=True)
            if val < best:
                best = val
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "logloss": val}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
