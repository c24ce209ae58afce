"""CTR model with the two huge id tables (user, item) split row-wise over all GPUs.

Row-wise sharding by hand: ids of the local batch are all-gathered, each rank
looks up the rows it owns (zeros for the others) and a reduce-scatter sums the
partial lookups and hands each rank the rows for its own samples. The small
side tables and the MLPs are ordinary DDP.

torchrun --nproc_per_node=8 06_rowwise_user_item_ctr.py --data /data/ctr/train.npz --val /data/ctr/val.npz
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SMALL_TABLES = {"hour": 24, "dow": 7, "device": 32, "item_cat": 4096, "country": 250}


class RowShardedEmbedding(nn.Module):
    def __init__(self, num_rows, dim, rank, world_size, device):
        super().__init__()
        self.rows_per_rank = math.ceil(num_rows / world_size)
        self.row_start = rank * self.rows_per_rank
        n_local = max(0, min(num_rows, self.row_start + self.rows_per_rank) - self.row_start)
        self.world_size = world_size
        self.weight = nn.Parameter(torch.empty(n_local, dim, device=device))
        nn.init.normal_(self.weight, std=0.01)

    def forward(self, ids):
        b = ids.size(0)
        gathered = ids.new_empty(b * self.world_size)
        dist.all_gather_into_tensor(gathered, ids.contiguous())
        local = gathered - self.row_start
        mask = (local >= 0) & (local < self.weight.size(0))
        partial = F.embedding(local.clamp(0, self.weight.size(0) - 1), self.weight) * mask.unsqueeze(1)
        if partial.requires_grad:
            partial.register_hook(lambda g: g / self.world_size)
        out = torch.empty(b, self.weight.size(1), device=ids.device, dtype=partial.dtype)
        return dist_nn.reduce_scatter(out, list(partial.chunk(self.world_size, dim=0)))


class DenseTower(nn.Module):
    def __init__(self, dim, num_dense):
        super().__init__()
        self.small_tables = nn.ModuleDict({k: nn.Embedding(n, dim) for k, n in SMALL_TABLES.items()})
        self.dense_proj = nn.Sequential(nn.Linear(num_dense, dim), nn.ReLU())
        in_dim = dim * (3 + len(SMALL_TABLES))
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, 512), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(512, 256), nn.ReLU(),
            nn.Linear(256, 1),
        )

    def forward(self, user_emb, item_emb, small_ids, dense):
        small = [self.small_tables[k](small_ids[:, i]) for i, k in enumerate(SMALL_TABLES)]
        x = torch.cat([user_emb, item_emb, self.dense_proj(dense)] + small, dim=1)
        return self.mlp(x).squeeze(1)


def load_npz(path):
    z = np.load(path)
    return TensorDataset(
        torch.from_numpy(z["user_id"].astype(np.int64)),
        torch.from_numpy(z["item_id"].astype(np.int64)),
        torch.from_numpy(z["small"].astype(np.int64)),
        torch.from_numpy(z["dense"].astype(np.float32)),
        torch.from_numpy(z["label"].astype(np.float32)),
    )


def run_epoch(loader, user_tbl, item_tbl, dense, sparse_opt, dense_opt, device, train=True):
    total = torch.zeros(2, device=device)
    for uid, iid, small, dfeat, y in loader:
        uid, iid = uid.to(device, non_blocking=True), iid.to(device, non_blocking=True)
        small, dfeat, y = small.to(device), dfeat.to(device), y.to(device)
        with torch.set_grad_enabled(train):
            logits = dense(user_tbl(uid), item_tbl(iid), small, dfeat)
            loss = F.binary_cross_entropy_with_logits(logits, y)
        if train:
            sparse_opt.zero_grad(set_to_none=True)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
        total[0] += loss.detach() * y.numel()
        total[1] += y.numel()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--num_users", type=int, default=200_000_000)
    p.add_argument("--num_items", type=int, default=40_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--sparse_lr", type=float, default=0.05)
    p.add_argument("--out", default="/shared/ckpt/rowwise_ctr")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    user_tbl = RowShardedEmbedding(args.num_users, args.dim, rank, world, device)
    item_tbl = RowShardedEmbedding(args.num_items, args.dim, rank, world, device)
    dense = DDP(DenseTower(args.dim, num_dense=8).to(device), device_ids=[local_rank])

    sparse_opt = torch.optim.Adagrad([user_tbl.weight, item_tbl.weight], lr=args.sparse_lr)
    dense_opt = torch.optim.AdamW(
        [
            {"params": dense.small_tables.parameters(), "weight_decay": 0.0},
            {"params": list(dense.dense_proj.parameters()) + list(dense.mlp.parameters()),
             "weight_decay": args.wd},
        ],
        lr=args.lr,
    )

    train_ds, val_ds = load_npz(args.data), load_npz(args.val)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              drop_last=True, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            drop_last=True, num_workers=2, pin_memory=True)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        user_tbl.train(), item_tbl.train(), dense.train()
        train_loss = run_epoch(train_loader, user_tbl, item_tbl, dense, sparse_opt, dense_opt, device)
        user_tbl.eval(), item_tbl.eval(), dense.eval()
        val_loss = run_epoch(val_loader, user_tbl, item_tbl, dense, sparse_opt, dense_opt, device, train=False)
        if rank == 0:
            print(f"epoch {epoch} train {train_loss:.5f} val {val_loss:.5f} ({time.time() - t0:.0f}s)", flush=True)

        torch.save(
            {"user": user_tbl.state_dict(), "item": item_tbl.state_dict(), "opt": sparse_opt.state_dict(),
             "rank": rank, "world_size": world},
            os.path.join(args.out, f"sparse_e{epoch}_r{rank}.pt"),
        )
        if rank == 0:
            torch.save({"dense": dense.module.state_dict(), "opt": dense_opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"dense_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
