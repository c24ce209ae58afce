"""Two-tower candidate retrieval model trained on click logs.

Moved off `accelerate launch` onto torchrun so it runs under the same job template as
the ranking models.

    torchrun --nnodes=1 --nproc_per_node=4 04_two_tower_retrieval.py --train data/clicks_train.parquet \
        --val data/clicks_val.parquet --item-table data/items.parquet
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--item-table", required=True)
    parser.add_argument("--emb-dim", type=int, default=128)
    parser.add_argument("--hist-len", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--save-dir", default="ckpt/two_tower")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class ClickDataset(Dataset):
    def __init__(self, path, hist_len):
        df = pd.read_parquet(path)
        self.user_ids = torch.as_tensor(df["user_idx"].values, dtype=torch.long)
        self.item_ids = torch.as_tensor(df["item_idx"].values, dtype=torch.long)
        hist = np.zeros((len(df), hist_len), dtype=np.int64)
        for i, h in enumerate(df["history"].values):
            h = h[-hist_len:]
            hist[i, : len(h)] = h
        self.history = torch.from_numpy(hist)

    def __len__(self):
        return self.user_ids.numel()

    def __getitem__(self, i):
        return self.user_ids[i], self.history[i], self.item_ids[i]


class UserTower(nn.Module):
    def __init__(self, n_users, n_items, dim):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, dim)
        self.hist_emb = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, user, hist):
        mask = (hist > 0).float().unsqueeze(-1)
        h = (self.hist_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return F.normalize(self.mlp(torch.cat([self.user_emb(user), h], dim=-1)), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, n_items, n_cats, dim):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, dim)
        self.cat_emb = nn.Embedding(n_cats, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, item, cat):
        return F.normalize(self.mlp(torch.cat([self.item_emb(item), self.cat_emb(cat)], dim=-1)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_cats, item_cat, dim):
        super().__init__()
        self.user_tower = UserTower(n_users, n_items, dim)
        self.item_tower = ItemTower(n_items, n_cats, dim)
        self.register_buffer("item_cat", item_cat)

    def forward(self, user, hist, item):
        u = self.user_tower(user, hist)
        v = self.item_tower(item, self.item_cat[item])
        return u, v


@torch.no_grad()
def recall_at_k(model, loader, device, k=100):
    """In-batch recall@k, summed over the local shard and reduced across ranks."""
    model.eval()
    stats = torch.zeros(2, device=device)
    for user, hist, item in loader:
        user, hist, item = user.to(device), hist.to(device), item.to(device)
        u, v = model(user, hist, item)
        scores = u @ v.T
        topk = scores.topk(min(k, scores.size(1)), dim=1).indices
        target = torch.arange(user.size(0), device=device).unsqueeze(1)
        stats[0] += (topk == target).any(dim=1).sum()
        stats[1] += user.size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    set_seed(args.seed)

    items = pd.read_parquet(args.item_table)
    item_cat = torch.zeros(len(items) + 1, dtype=torch.long)
    item_cat[torch.as_tensor(items["item_idx"].values)] = torch.as_tensor(items["cat_idx"].values)
    n_users = int(pd.read_parquet(args.train, columns=["user_idx"])["user_idx"].max()) + 1

    train_set = ClickDataset(args.train, args.hist_len)
    val_set = ClickDataset(args.val, args.hist_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=4, pin_memory=True, drop_last=True)

    model = TwoTower(n_users, len(items), int(items["cat_idx"].max()) + 1, item_cat, args.emb_dim).to(device)
    model = DDP(model, device_ids=[device.index])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps,
                                                    pct_start=0.05)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"users={n_users} items={len(items)} world={world} steps={total_steps}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for step, (user, hist, item) in enumerate(train_loader):
            user = user.to(device, non_blocking=True)
            hist = hist.to(device, non_blocking=True)
            item = item.to(device, non_blocking=True)
            u, v = model(user, hist, item)
            logits = u @ v.T / args.temperature
            labels = torch.arange(u.size(0), device=device)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter[0] += loss.detach()
            meter[1] += 1
            if step % 200 == 0:
                snapshot = meter.clone()
                dist.all_reduce(snapshot)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {(snapshot[0] / snapshot[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        rec = recall_at_k(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val recall@100 {rec:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "recall": rec, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if rec > best:
                best = rec
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
