"""DCN-v2 on the Criteo display-ads day files.

Raw TSV days (day_0 ... day_6) are hashed once into .npy arrays under
--cache-dir and memory-mapped afterwards; later runs reuse the cache.
"""
import argparse
import hashlib
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_DENSE, N_SPARSE = 13, 26

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("dcn")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--raw-dir", default="/datasets/criteo/days")
    p.add_argument("--cache-dir", default="/datasets/criteo/hashed_v3")
    p.add_argument("--train-days", type=int, nargs="+", default=list(range(0, 6)))
    p.add_argument("--valid-day", type=int, default=6)
    p.add_argument("--buckets", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--deep", default="768,768,512")
    p.add_argument("--bs", type=int, default=8192)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ckpt", default="/datasets/criteo/runs/dcn_v2.pt")
    return p.parse_args()


def stable_hash(field, value, buckets):
    h = hashlib.blake2b(f"{field}\x01{value}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % buckets


def hash_day(raw_path, buckets):
    labels, dense, sparse = [], [], []
    with open(raw_path) as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            labels.append(int(cols[0]))
            dense.append([float(c) if c else 0.0 for c in cols[1:1 + N_DENSE]])
            sparse.append([stable_hash(j, c, buckets) for j, c in enumerate(cols[1 + N_DENSE:])])
    return (np.asarray(labels, dtype=np.float32),
            np.log1p(np.maximum(np.asarray(dense, dtype=np.float32), 0.0)),
            np.asarray(sparse, dtype=np.int32))


def get_day(args, day):
    base = os.path.join(args.cache_dir, f"day_{day}")
    paths = [base + s for s in ("_y.npy", "_dense.npy", "_sparse.npy")]
    if not all(os.path.exists(p) for p in paths):
        log.info("hashing day %d into %s", day, args.cache_dir)
        os.makedirs(args.cache_dir, exist_ok=True)
        arrays = hash_day(os.path.join(args.raw_dir, f"day_{day}"), args.buckets)
        for p, a in zip(paths, arrays):
            np.save(p, a)
    return [np.load(p, mmap_mode="r") for p in paths]


class Days(Dataset):
    """Concatenation of memory-mapped days without copying them into RAM."""

    def __init__(self, parts):
        self.parts = parts
        self.bounds = np.cumsum([0] + [len(p[0]) for p in parts])

    def __len__(self):
        return int(self.bounds[-1])

    def __getitem__(self, i):
        d = int(np.searchsorted(self.bounds, i, side="right")) - 1
        j = i - self.bounds[d]
        y, dense, sparse = self.parts[d]
        return np.array(dense[j]), sparse[j].astype(np.int64), y[j]


class CrossNet(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCNv2(nn.Module):
    def __init__(self, buckets, dim, n_cross, deep):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(buckets, dim) for _ in range(N_SPARSE))
        for e in self.emb:
            nn.init.xavier_uniform_(e.weight)
        d_in = N_DENSE + N_SPARSE * dim
        self.cross = CrossNet(d_in, n_cross)
        layers, d = [], d_in
        for h in deep:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU()]
            d = h
        self.deep = nn.Sequential(*layers)
        self.head = nn.Linear(d_in + d, 1)

    def forward(self, dense, sparse):
        x0 = torch.cat([dense] + [e(sparse[:, j]) for j, e in enumerate(self.emb)], dim=1)
        return self.head(torch.cat([self.cross(x0), self.deep(x0)], dim=1)).squeeze(1)


@torch.no_grad()
def run_eval(model, loader, device, n):
    model.eval()
    ps, ys = [], []
    for dense, sparse, y in loader:
        ps.append(torch.sigmoid(model(dense.to(device), sparse.to(device))))
        ys.append(y.to(device))
    p, y = torch.cat(ps), torch.cat(ys)
    P = [torch.empty_like(p) for _ in range(dist.get_world_size())]
    Y = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(P, p)
    dist.all_gather(Y, y)
    model.train()
    p = torch.stack(P, 1).flatten()[:n].double().cpu().numpy()
    y = torch.stack(Y, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p), log_loss(y, p)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)

    train = Days([get_day(args, d) for d in args.train_days])
    valid = Days([get_day(args, args.valid_day)])
    if rank == 0:
        log.info("train %d rows, valid %d rows", len(train), len(valid))

    tr_sampler = DistributedSampler(train, shuffle=True)
    tr = DataLoader(train, batch_size=args.bs, sampler=tr_sampler, num_workers=8,
                    pin_memory=True, drop_last=True)
    va = DataLoader(valid, batch_size=args.bs, sampler=DistributedSampler(valid, shuffle=False),
                    num_workers=8, pin_memory=True)

    model = DCNv2(args.buckets, args.dim, args.cross_layers, [int(h) for h in args.deep.split(",")])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev)
    model = DDP(model, device_ids=[lr_])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (dense, sparse, y) in enumerate(tr):
            logits = model(dense.to(dev, non_blocking=True), sparse.to(dev, non_blocking=True))
            loss = F.binary_cross_entropy_with_logits(logits, y.to(dev, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 500 == 0:
                log.info("ep %d it %d/%d loss %.5f (%.0fs)", epoch, it, len(tr), loss.item(), time.time() - t0)

        auc, ll = run_eval(model, va, dev, len(valid))
        if rank == 0:
            log.info("ep %d valid auc %.5f logloss %.5f", epoch, auc, ll)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
