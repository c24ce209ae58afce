"""Feed CTR model with multi-hot features, streamed from day-partitioned parquet.

Layout: {root}/day=YYYYMMDD/part-XXXXX.parquet with columns
  label, d0..d9 (float), s0..s19 (hashed int64), tags (list<int64>), hist (list<int64>)

The files of a day are split over ranks, and inside a rank over DataLoader
workers, so no row is read twice. Since the files hold different numbers of
rows, all ranks agree on the number of steps per epoch up front.

    torchrun --standalone --nproc_per_node=8 08_multihot_stream.py --train-days 20240301-20240314
"""
import argparse
import glob
import math
import os
import random
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
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

DENSE = [f"d{i}" for i in range(10)]
SPARSE = [f"s{i}" for i in range(20)]
MULTI = ["tags", "hist"]


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/lustre/feed_ctr")
    ap.add_argument("--train-days", default="20240301-20240314")
    ap.add_argument("--eval-day", default="20240315")
    ap.add_argument("--buckets", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="/mnt/lustre/runs/feed_ctr")
    return ap.parse_args()


def list_files(root, spec):
    a, b = spec.split("-") if "-" in spec else (spec, spec)
    days = pd.date_range(a, b).strftime("%Y%m%d")
    return sorted(f for d in days for f in glob.glob(f"{root}/day={d}/*.parquet"))


def to_batch(df):
    out = {"label": torch.from_numpy(df["label"].to_numpy(np.float32)),
           "dense": torch.from_numpy(np.log1p(df[DENSE].clip(lower=0).to_numpy(np.float32))),
           "sparse": torch.from_numpy(df[SPARSE].to_numpy(np.int64))}
    for col in MULTI:
        lists = df[col].tolist()
        lens = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
        out[col] = torch.from_numpy(np.concatenate(lists).astype(np.int64)) if lens.sum() else torch.zeros(0, dtype=torch.long)
        out[col + "_off"] = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)[:-1]]))
    return out


class ParquetStream(IterableDataset):
    def __init__(self, files, batch, rank, world, seed, shuffle, drop_last):
        self.files, self.batch, self.rank, self.world = files, batch, rank, world
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def rank_files(self):
        files = list(self.files)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(files)  # same order on every rank
        return files[self.rank::self.world]

    def worker_files(self, wid, nw):
        return self.rank_files()[wid::nw]

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rng = np.random.default_rng(self.seed + 1000 * self.epoch + 97 * self.rank + wid)
        buf = []
        for f in self.worker_files(wid, nw):
            df = pd.read_parquet(f, columns=["label"] + DENSE + SPARSE + MULTI)
            if self.shuffle:
                df = df.iloc[rng.permutation(len(df))]
            buf.append(df)
            cur = pd.concat(buf, ignore_index=True)
            n_full = len(cur) // self.batch
            for k in range(n_full):
                yield to_batch(cur.iloc[k * self.batch:(k + 1) * self.batch])
            buf = [cur.iloc[n_full * self.batch:]]
        rest = pd.concat(buf, ignore_index=True) if buf else None
        if rest is not None and len(rest) and not self.drop_last:
            yield to_batch(rest)


def steps_per_epoch(ds, num_workers, device):
    """Full batches this rank is guaranteed to produce, then the minimum over ranks."""
    n = 0
    for w in range(max(num_workers, 1)):
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in ds.worker_files(w, max(num_workers, 1)))
        n += rows // ds.batch
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class FeedCTR(nn.Module):
    def __init__(self, buckets, dim):
        super().__init__()
        self.sparse = nn.ModuleList(nn.Embedding(buckets, dim) for _ in SPARSE)
        self.multi = nn.ModuleDict({c: nn.EmbeddingBag(buckets, dim, mode="mean") for c in MULTI})
        self.dense = nn.Sequential(nn.Linear(len(DENSE), dim), nn.ReLU())
        n = len(SPARSE) + len(MULTI) + 1
        self.mlp = nn.Sequential(nn.Linear(n * dim, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                                 nn.Linear(512, 1))

    def forward(self, b):
        parts = [self.dense(b["dense"])]
        parts += [e(b["sparse"][:, i]) for i, e in enumerate(self.sparse)]
        parts += [self.multi[c](b[c], b[c + "_off"]) for c in MULTI]
        return self.mlp(torch.cat(parts, dim=1)).squeeze(1)


def to_dev(b, device):
    return {k: v.to(device, non_blocking=True) for k, v in b.items()}


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    p, y = [], []
    for b in loader:
        b = to_dev(b, device)
        p.append(torch.sigmoid(model(b)))
        y.append(b["label"])
    p = torch.cat(p) if p else torch.zeros(0, device=device)
    y = torch.cat(y) if y else torch.zeros(0, device=device)
    # ranks hold different numbers of rows: pad to the largest before gathering
    n = torch.tensor([p.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    m = int(max(s.item() for s in sizes))
    pp = [torch.zeros(m, device=device) for _ in range(world)]
    yy = [torch.zeros(m, device=device) for _ in range(world)]
    dist.all_gather(pp, F.pad(p, (0, m - p.numel())))
    dist.all_gather(yy, F.pad(y, (0, m - y.numel())))
    model.train()
    p = torch.cat([t[:int(s.item())] for t, s in zip(pp, sizes)]).cpu().numpy()
    y = torch.cat([t[:int(s.item())] for t, s in zip(yy, sizes)]).cpu().numpy()
    return roc_auc_score(y, p)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(a.seed)

    train_files = list_files(a.root, a.train_days)
    eval_files = list_files(a.root, a.eval_day)
    assert len(train_files) >= world * a.workers and len(eval_files) >= world, "not enough parquet parts"

    train_ds = ParquetStream(train_files, a.batch, rank, world, a.seed, shuffle=True, drop_last=True)
    eval_ds = ParquetStream(eval_files, 8192, rank, world, a.seed, shuffle=False, drop_last=False)
    train_dl = DataLoader(train_ds, batch_size=None, num_workers=a.workers, pin_memory=True)
    eval_dl = DataLoader(eval_ds, batch_size=None, num_workers=2, pin_memory=True)

    model = DDP(FeedCTR(a.buckets, a.dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    best = 0.0
    for epoch in range(a.epochs):
        train_ds.set_epoch(epoch)
        steps = steps_per_epoch(train_ds, a.workers, device)
        if rank == 0:
            print(f"epoch {epoch}: {steps} steps/rank, {len(train_files)} files", flush=True)
        t0 = time.time()
        for step, b in zip(range(steps), train_dl):
            b = to_dev(b, device)
            loss = F.binary_cross_entropy_with_logits(model(b), b["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"  step {step}/{steps} loss {loss.item():.5f} {time.time() - t0:.0f}s", flush=True)

        auc = evaluate(model, eval_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch} eval auc {auc:.5f}", flush=True)
            torch.save(model.module.state_dict(), os.path.join(a.out, "last.pt"))
            if auc > best:
                best = auc
                torch.save(model.module.state_dict(), os.path.join(a.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
