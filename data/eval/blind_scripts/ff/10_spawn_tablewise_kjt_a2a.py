"""Single-node table-wise model parallel DLRM, started with torch.multiprocessing.

    python 10_spawn_tablewise_kjt_a2a.py --data /data/kaggle_criteo/train.txt --gpus 8

Sparse ids go through an input all-to-all to the rank owning each table and the
pooled embeddings come back through an output all-to-all (the same two-step
layout TorchRec uses for table-wise sharding).
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_DENSE, N_SPARSE = 13, 26


def preprocess(txt_path, cache_dir, hash_size):
    """Runs once in the parent process, before any worker exists."""
    out = os.path.join(cache_dir, f"kaggle_h{hash_size}")
    if os.path.exists(os.path.join(out, "DONE")):
        return out
    os.makedirs(out, exist_ok=True)
    labels, dense, sparse = [], [], []
    with open(txt_path) as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            labels.append(int(cols[0]))
            dense.append([float(x) if x else 0.0 for x in cols[1 : 1 + N_DENSE]])
            sparse.append([int(x, 16) % hash_size if x else 0 for x in cols[1 + N_DENSE :]])
    np.save(os.path.join(out, "labels.npy"), np.asarray(labels, dtype=np.float32))
    np.save(os.path.join(out, "dense.npy"), np.log1p(np.maximum(np.asarray(dense, dtype=np.float32), 0)))
    np.save(os.path.join(out, "sparse.npy"), np.asarray(sparse, dtype=np.int64))
    open(os.path.join(out, "DONE"), "w").close()
    return out


class KaggleCriteo(Dataset):
    def __init__(self, cache, split, val_fraction=0.1):
        labels = np.load(os.path.join(cache, "labels.npy"), mmap_mode="r")
        n = len(labels)
        cut = int(n * (1 - val_fraction))  # time ordered file: last 10% is validation
        sl = slice(0, cut) if split == "train" else slice(cut, n)
        self.labels = labels[sl]
        self.dense = np.load(os.path.join(cache, "dense.npy"), mmap_mode="r")[sl]
        self.sparse = np.load(os.path.join(cache, "sparse.npy"), mmap_mode="r")[sl]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return np.array(self.dense[i]), np.array(self.sparse[i]), np.float32(self.labels[i])


class TableWiseEmbeddings(nn.Module):
    def __init__(self, hash_size, dim, rank, world_size, device):
        super().__init__()
        self.rank, self.world_size, self.dim = rank, world_size, dim
        # round-robin: feature f lives on rank f % world_size
        self.owned = [[f for f in range(N_SPARSE) if f % world_size == r] for r in range(world_size)]
        self.tables = nn.ModuleList(
            [nn.EmbeddingBag(hash_size, dim, mode="sum", sparse=True, device=device) for _ in self.owned[rank]]
        )
        order = torch.tensor([f for fs in self.owned for f in fs])
        self.register_buffer("restore", torch.argsort(order).to(device), persistent=False)

    def forward(self, sparse):
        b = sparse.size(0)
        mine = self.owned[self.rank]
        # input dist: every rank sends the ids of feature group r to rank r
        send_ids = torch.cat([sparse[:, fs].t().reshape(-1) for fs in self.owned])
        recv_ids = sparse.new_empty(self.world_size * b * len(mine))
        dist.all_to_all_single(
            recv_ids, send_ids,
            output_split_sizes=[b * len(mine)] * self.world_size,
            input_split_sizes=[b * len(fs) for fs in self.owned],
        )
        recv_ids = recv_ids.view(self.world_size, len(mine), b)
        pooled = torch.stack(
            [self.tables[j](recv_ids[:, j, :].reshape(-1, 1)).view(self.world_size, b, self.dim)
             for j in range(len(mine))],
            dim=2,
        )  # [world, b, len(mine), dim]
        if pooled.requires_grad:
            pooled.register_hook(lambda g: g / self.world_size)
        out = torch.empty(sum(b * len(fs) * self.dim for fs in self.owned), device=sparse.device)
        out = dist_nn.all_to_all_single(
            out, pooled.reshape(-1),
            output_split_sizes=[b * len(fs) * self.dim for fs in self.owned],
            input_split_sizes=[b * len(mine) * self.dim] * self.world_size,
        )
        chunks = [c.view(b, len(fs), self.dim) for c, fs in zip(out.split([b * len(fs) * self.dim for fs in self.owned]), self.owned)]
        return torch.cat(chunks, dim=1)[:, self.restore]


class Dense(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(N_DENSE, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        n = N_SPARSE + 1
        self.register_buffer("iu", torch.triu_indices(n, n, 1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 512), nn.ReLU(),
                                 nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense, emb):
        x = self.bottom(dense)
        z = torch.cat([x[:, None], emb], dim=1)
        inter = (z @ z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(-1)


def worker(rank, world_size, args, cache):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)

    train_ds, val_ds = KaggleCriteo(cache, "train"), KaggleCriteo(cache, "val")
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=4, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=val_sampler, drop_last=True,
                            num_workers=4, pin_memory=True)

    emb = TableWiseEmbeddings(args.hash_size, args.dim, rank, world_size, device)
    dense = DDP(Dense(args.dim).to(device), device_ids=[rank], gradient_as_bucket_view=True)
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=args.sparse_lr)
    dense_opt = torch.optim.Adam(dense.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        emb.train(), dense.train()
        t0 = time.time()
        for it, (d, s, y) in enumerate(train_loader):
            d, s, y = d.to(device, non_blocking=True), s.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(dense(d, emb(s)), y)
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            if rank == 0 and it % 500 == 0:
                print(f"[{epoch}:{it}] loss {loss.item():.4f} {(time.time() - t0) / (it + 1) * 1e3:.1f} ms/it", flush=True)

        emb.eval(), dense.eval()
        acc = torch.zeros(3, device=device)
        with torch.no_grad():
            for d, s, y in val_loader:
                d, s, y = d.to(device), s.to(device), y.to(device)
                logits = dense(d, emb(s))
                acc[0] += F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
                acc[1] += ((logits > 0).float() == y).sum()
                acc[2] += y.numel()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val logloss {acc[0] / acc[2]:.5f} acc {acc[1] / acc[2]:.4f}", flush=True)

        os.makedirs(args.out, exist_ok=True)
        torch.save({"owned": emb.owned[rank], "tables": emb.state_dict()},
                   os.path.join(args.out, f"tables_rank{rank}_ws{world_size}.pt"))
        if rank == 0:
            torch.save({"dense": dense.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "dense.pt"))
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache_dir", default="/scratch/criteo_cache")
    ap.add_argument("--out", default="./ckpt_tw")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--hash_size", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sparse_lr", type=float, default=1e-2)
    args = ap.parse_args()

    assert 1 <= args.gpus <= torch.cuda.device_count()
    cache = preprocess(args.data, args.cache_dir, args.hash_size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args, cache), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
