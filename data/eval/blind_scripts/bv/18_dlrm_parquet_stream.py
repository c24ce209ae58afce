"""DLRM trained by streaming hourly parquet partitions (too big for RAM).

    /data/lake/ctr_events/dt=2024-06-03/hr=17/part-00042.parquet

torchrun --standalone --nproc_per_node=8 18_dlrm_parquet_stream.py --dates 2024-06-01,2024-06-02,2024-06-03
"""
import argparse
import glob
import json
import math
import os
import random
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchmetrics.classification import BinaryAUROC

N_DENSE = 16
N_SPARSE = 24


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lake", default="/data/lake/ctr_events")
    ap.add_argument("--dates", default="2024-06-01,2024-06-02,2024-06-03")
    ap.add_argument("--eval-date", default="2024-06-04")
    ap.add_argument("--cardinality", default="/data/lake/ctr_events/_cardinality.json")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shuffle-buffer", type=int, default=200_000)
    ap.add_argument("--ckpt", default="/data/lake/models/dlrm_stream")
    return ap.parse_args()


class ParquetEvents(IterableDataset):
    def __init__(self, files, batch, shuffle_buffer=0, seed=0):
        super().__init__()
        self.files = files
        self.batch = batch
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed

    def _my_files(self):
        info = get_worker_info()
        if info is None:
            return self.files
        return self.files[info.id::info.num_workers]

    def _batches(self, table):
        y = table.column("label").to_numpy().astype(np.float32)
        dense = np.stack([table.column(f"f{i}").to_numpy(zero_copy_only=False) for i in range(N_DENSE)], 1)
        dense = np.log1p(np.clip(np.nan_to_num(dense.astype(np.float32)), 0, None))
        sparse = np.stack([table.column(f"c{i}").to_numpy() for i in range(N_SPARSE)], 1).astype(np.int64)
        return y, dense, sparse

    def __iter__(self):
        rng = random.Random(self.seed + (get_worker_info().id if get_worker_info() else 0))
        files = list(self._my_files())
        rng.shuffle(files)
        buf_y, buf_d, buf_s = [], [], []
        n_buf = 0
        for f in files:
            pf = pq.ParquetFile(f)
            for rg in range(pf.num_row_groups):
                y, d, s = self._batches(pf.read_row_group(rg))
                buf_y.append(y), buf_d.append(d), buf_s.append(s)
                n_buf += len(y)
                if n_buf >= max(self.shuffle_buffer, self.batch):
                    yield from self._flush(buf_y, buf_d, buf_s, rng, keep_tail=True)
                    n_buf = len(buf_y[0]) if buf_y else 0
        yield from self._flush(buf_y, buf_d, buf_s, rng, keep_tail=False)

    def _flush(self, by, bd, bs, rng, keep_tail):
        y, d, s = np.concatenate(by), np.concatenate(bd), np.concatenate(bs)
        perm = np.random.default_rng(rng.randrange(1 << 30)).permutation(len(y)) if self.shuffle_buffer else np.arange(len(y))
        n_full = len(y) // self.batch
        for k in range(n_full):
            idx = perm[k * self.batch:(k + 1) * self.batch]
            yield torch.from_numpy(d[idx]), torch.from_numpy(s[idx]), torch.from_numpy(y[idx])
        by.clear(), bd.clear(), bs.clear()
        tail = perm[n_full * self.batch:]
        if keep_tail and len(tail):
            by.append(y[tail]), bd.append(d[tail]), bs.append(s[tail])


class DLRM(nn.Module):
    def __init__(self, cards, dim):
        super().__init__()
        self.emb = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum") for c in cards)
        for e in self.emb:
            bound = math.sqrt(1.0 / e.num_embeddings)
            nn.init.uniform_(e.weight, -bound, bound)
        self.bottom = nn.Sequential(nn.Linear(N_DENSE, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                    nn.Linear(256, dim), nn.ReLU())
        k = N_SPARSE + 1
        self.top = nn.Sequential(nn.Linear(dim + k * (k - 1) // 2, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                 nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1))
        li, lj = torch.tril_indices(k, k, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = torch.stack([x] + [e(sparse[:, i:i + 1]) for i, e in enumerate(self.emb)], 1)
        z = torch.bmm(feats, feats.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, z], 1)).squeeze(1)


def list_files(lake, dates):
    return sorted(f for d in dates for f in glob.glob(f"{lake}/dt={d}/hr=*/*.parquet"))


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.cardinality) as f:
        cards = json.load(f)["sparse"]
    train_files = list_files(args.lake, args.dates.split(","))
    eval_files = list_files(args.lake, [args.eval_date])

    train_ds = ParquetEvents(train_files, args.batch, shuffle_buffer=args.shuffle_buffer, seed=17)
    eval_ds = ParquetEvents(eval_files, 16384)
    train_dl = DataLoader(train_ds, batch_size=None, num_workers=args.workers, pin_memory=True,
                          prefetch_factor=4)
    eval_dl = DataLoader(eval_ds, batch_size=None, num_workers=4, pin_memory=True)

    model = DDP(DLRM(cards, args.dim).to(device), device_ids=[local_rank])
    # DLRM reference setup: plain SGD with a large lr on both embeddings and MLPs
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
        print(f"{len(train_files)} train files, {len(eval_files)} eval files, world {world}", flush=True)

    t0 = time.time()
    for step, (dense, sparse, y) in enumerate(train_dl):
        dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), y.to(device)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 500 == 0:
            print(f"step {step} loss {loss.item():.5f} "
                  f"{500 * args.batch * world / (time.time() - t0):.0f} ex/s", flush=True)
            t0 = time.time()

    model.eval()
    auroc = BinaryAUROC().to(device)
    with torch.no_grad():
        for dense, sparse, y in eval_dl:
            logits = model(dense.to(device), sparse.to(device))
            auroc.update(torch.sigmoid(logits), y.to(device).long())
    auc = auroc.compute().item()
    if rank == 0:
        print(f"eval {args.eval_date} auc {auc:.5f}", flush=True)
        torch.save({"model": model.module.state_dict(), "dates": args.dates, "auc": auc},
                   os.path.join(args.ckpt, f"dlrm_{args.dates.split(',')[-1]}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
