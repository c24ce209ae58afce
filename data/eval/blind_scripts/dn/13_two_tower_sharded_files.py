"""Two-tower retrieval, streamed from sharded parquet click logs.

* every rank streams a disjoint subset of files (split again over loader workers)
* the number of steps per epoch is agreed on up front (min over ranks, computed
  from parquet footers), so all ranks stop on the same step
* negatives = positives of the whole global batch (all_gather with autograd)

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        13_two_tower_sharded_files.py --files "/lustre/recsys/clicks/dt=2024-06-*/*.parquet"
"""
import argparse
import glob
import logging
import os
import random
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

log = logging.getLogger("tt")


def shard_files(files, epoch, seed, rank, world, worker, num_workers):
    files = list(files)
    random.Random(seed + epoch).shuffle(files)
    return files[rank::world][worker::num_workers]


class PairStream(IterableDataset):
    """Yields ready-made batches of exactly `batch_size` (user_id, item_id, item_cat) rows."""

    def __init__(self, files, batch_size, rank, world, num_workers, seed=0):
        self.files, self.bs = files, batch_size
        self.rank, self.world, self.num_workers = rank, world, num_workers
        self.seed, self.epoch = seed, 0

    def __iter__(self):
        wi = get_worker_info()
        wid = wi.id if wi is not None else 0
        nw = wi.num_workers if wi is not None else 1
        assert nw == self.num_workers
        mine = shard_files(self.files, self.epoch, self.seed, self.rank, self.world, wid, nw)
        rng = np.random.default_rng(self.seed + 1000 * self.epoch + 7 * self.rank + wid)
        carry = None
        for f in mine:
            t = pq.read_table(f, columns=["user_id", "item_id", "item_cat"])
            arr = np.stack([t.column(c).to_numpy().astype(np.int64) for c in ("user_id", "item_id", "item_cat")], 1)
            rng.shuffle(arr)
            if carry is not None:
                arr = np.concatenate([carry, arr])
            n_full = len(arr) // self.bs
            for i in range(n_full):
                yield torch.from_numpy(arr[i * self.bs:(i + 1) * self.bs])
            carry = arr[n_full * self.bs:]


def local_num_batches(files, epoch, seed, rank, world, num_workers, bs):
    total = 0
    for w in range(num_workers):
        rows = sum(pq.ParquetFile(f).metadata.num_rows
                   for f in shard_files(files, epoch, seed, rank, world, w, num_workers))
        total += rows // bs
    return total


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_cats, dim=64):
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.item = nn.Embedding(n_items, dim)
        self.cat = nn.Embedding(n_cats, dim)
        self.user_mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, dim))
        self.item_mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))  # log(1/0.07)

    def forward(self, b):
        u = F.normalize(self.user_mlp(self.user(b[:, 0])), dim=-1)
        v = F.normalize(self.item_mlp(torch.cat([self.item(b[:, 1]), self.cat(b[:, 2])], -1)), dim=-1)
        return u, v, self.logit_scale.exp().clamp(max=100)


@torch.no_grad()
def recall_at_k(net, val_path, corpus_path, device, rank, world, k=100, bs=8192):
    net.eval()
    corpus = pq.read_table(corpus_path, columns=["item_id", "item_cat"])
    items = torch.from_numpy(corpus.column("item_id").to_numpy().astype(np.int64)).to(device)
    cats = torch.from_numpy(corpus.column("item_cat").to_numpy().astype(np.int64)).to(device)
    vecs = torch.cat([F.normalize(net.item_mlp(torch.cat([net.item(items[i:i + bs]), net.cat(cats[i:i + bs])], -1)),
                                  dim=-1) for i in range(0, items.numel(), bs)])
    val = pq.read_table(val_path, columns=["user_id", "item_id"])
    users = torch.from_numpy(val.column("user_id").to_numpy().astype(np.int64)[rank::world])
    targets = torch.from_numpy(val.column("item_id").to_numpy().astype(np.int64)[rank::world])
    hit = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(0, users.numel(), bs):
        u = F.normalize(net.user_mlp(net.user(users[i:i + bs].to(device))), dim=-1)
        top = items[(u @ vecs.t()).topk(k, dim=-1).indices]
        hit[0] += (top == targets[i:i + bs].to(device).unsqueeze(1)).any(1).sum()
        hit[1] += top.size(0)
    dist.all_reduce(hit)
    net.train()
    return (hit[0] / hit[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", required=True, help="glob of parquet files")
    ap.add_argument("--val", default="/lustre/recsys/clicks/eval/val_pairs.parquet")
    ap.add_argument("--corpus", default="/lustre/recsys/clicks/eval/items.parquet")
    ap.add_argument("--out", default="/lustre/recsys/ckpt/tt_sharded")
    ap.add_argument("--n_users", type=int, default=30_000_000)
    ap.add_argument("--n_items", type=int, default=4_000_000)
    ap.add_argument("--n_cats", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    files = sorted(glob.glob(args.files))
    assert len(files) >= world * args.workers, f"need at least {world * args.workers} files, got {len(files)}"
    ds = PairStream(files, args.batch_size, rank, world, args.workers, args.seed)
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True,
                        persistent_workers=False)

    torch.manual_seed(args.seed)
    model = DDP(TwoTower(args.n_users, args.n_items, args.n_cats, args.dim).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        ds.epoch = epoch
        n_local = local_num_batches(files, epoch, args.seed, rank, world, args.workers, args.batch_size)
        n = torch.tensor([n_local], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        steps = int(n.item())
        log.info("epoch %d: %d steps (rank0 has %d batches)", epoch, steps, n_local)

        t0 = time.time()
        it = iter(loader)
        for step in range(steps):
            b = next(it).to(device, non_blocking=True)
            u, v, scale = model(b)
            all_v = torch.cat(torch.distributed.nn.all_gather(v), 0)
            logits = scale * (u @ all_v.t())
            labels = torch.arange(u.size(0), device=device) + rank * u.size(0)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (step + 1) % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d/%d loss %.4f scale %.1f %.2f s/100it", epoch, step + 1, steps,
                         l.item(), scale.item(), (time.time() - t0) / 2)
                t0 = time.time()
        del it  # shuts the workers down; the remaining batches of this epoch are dropped

        r = recall_at_k(model.module, args.val, args.corpus, device, rank, world)
        log.info("epoch %d recall@100 %.4f", epoch, r)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
