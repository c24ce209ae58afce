"""Two-tower retrieval model (query tower / item tower) trained with in-batch negatives.

Vertex AI CustomJob, 2 replicas of a2-highgpu-8g; the worker pool command is
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=${RANK} \
        --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} train_two_tower.py \
        --data /gcs/reco-prod/interactions/2024-06 --ckpt-dir /gcs/reco-prod/ckpt/two-tower
"""
import argparse
import glob
import os
import time

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--n-users", type=int, default=2_000_000)
    p.add_argument("--n-items", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--temperature", type=float, default=0.05)
    return p.parse_args()


class InteractionDataset(Dataset):
    def __init__(self, files):
        tables = [pq.read_table(f, columns=["user_id", "item_id", "hour", "device"]) for f in files]
        cols = {c: torch.cat([torch.from_numpy(t[c].to_numpy()) for t in tables]) for c in tables[0].column_names}
        self.user = cols["user_id"].long()
        self.item = cols["item_id"].long()
        self.hour = cols["hour"].long()
        self.device = cols["device"].long()

    def __len__(self):
        return self.user.numel()

    def __getitem__(self, i):
        return self.user[i], self.hour[i], self.device[i], self.item[i]


class QueryTower(nn.Module):
    def __init__(self, n_users, dim):
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.hour = nn.Embedding(24, 16)
        self.device = nn.Embedding(8, 8)
        self.mlp = nn.Sequential(nn.Linear(dim + 24, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, u, h, d):
        x = torch.cat([self.user(u), self.hour(h), self.device(d)], dim=-1)
        return F.normalize(self.mlp(x), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, n_items, dim):
        super().__init__()
        self.item = nn.Embedding(n_items, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, i):
        return F.normalize(self.mlp(self.item(i)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, dim):
        super().__init__()
        self.query = QueryTower(n_users, dim)
        self.items = ItemTower(n_items, dim)

    def forward(self, u, h, d, i):
        return self.query(u, h, d), self.items(i)


@torch.no_grad()
def evaluate(model, loader, device, k=100):
    """Recall@k of the true item against the other items of the same eval batch."""
    model.eval()
    hits = torch.zeros(2, device=device)
    for u, h, d, i in loader:
        u, h, d, i = u.to(device), h.to(device), d.to(device), i.to(device)
        q, v = model(u, h, d, i)
        scores = q @ v.T
        topk = scores.topk(min(k, scores.size(1)), dim=1).indices
        target = torch.arange(u.size(0), device=device)[:, None]
        hits[0] += (topk == target).any(dim=1).sum()
        hits[1] += u.size(0)
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.parquet")))
    eval_files = sorted(glob.glob(os.path.join(args.data, "eval", "*.parquet")))
    train_ds = InteractionDataset(train_files)
    eval_ds = InteractionDataset(eval_files)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    eval_part = torch.utils.data.Subset(eval_ds, range(rank, len(eval_ds), world))
    eval_dl = DataLoader(eval_part, batch_size=1024, num_workers=2, drop_last=True)

    model = TwoTower(args.n_users, args.n_items, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_recall = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (u, h, d, i) in enumerate(train_dl):
            u, h, d, i = (t.to(device, non_blocking=True) for t in (u, h, d, i))
            q, v = model(u, h, d, i)
            logits = q @ v.T / args.temperature
            labels = torch.arange(q.size(0), device=device)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(train_dl)} loss {l.item():.4f} "
                          f"({time.time() - t0:.0f}s)", flush=True)

        if rank == 0:
            recall = evaluate(model, eval_dl, device)
            print(f"epoch {epoch} recall@100 {recall:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "recall": recall}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if recall > best_recall:
                best_recall = recall
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
