#!/usr/bin/env python
"""Two-tower retrieval with cross-GPU in-batch negatives.

Each rank encodes its own (user, clicked item) pairs; item embeddings from all
ranks are gathered (with gradient) so every user sees world_size * B candidates.
A logQ correction with streaming item frequencies (Yi et al., RecSys'19) removes
the popularity bias of in-batch sampling.

    torchrun --nproc_per_node=4 02_two_tower_allgather_negs.py \
        --train data/clicks_train.parquet --val data/clicks_val.parquet \
        --num-users 2000000 --num-items 800000
"""
import argparse
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--num-users", type=int, required=True)
    p.add_argument("--num-items", type=int, required=True)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hist-len", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--out", default="ckpt/two_tower")
    p.add_argument("--resume", default="")
    return p.parse_args()


class ClickPairs(Dataset):
    def __init__(self, path, hist_len):
        df = pd.read_parquet(path, columns=["user_id", "item_id", "hist"])
        self.users = torch.as_tensor(df.user_id.values, dtype=torch.long)
        self.items = torch.as_tensor(df.item_id.values, dtype=torch.long)
        self.hist = df.hist.values
        self.hist_len = hist_len

    def __len__(self):
        return len(self.users)

    def __getitem__(self, i):
        h = list(self.hist[i][-self.hist_len:])
        h = [0] * (self.hist_len - len(h)) + h  # item 0 is padding
        return self.users[i], torch.tensor(h, dtype=torch.long), self.items[i]


class UserTower(nn.Module):
    def __init__(self, num_users, num_items, dim):
        super().__init__()
        self.user_emb = nn.Embedding(num_users, dim)
        self.hist_emb = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, user, hist):
        mask = (hist > 0).float().unsqueeze(-1)
        h = (self.hist_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return F.normalize(self.mlp(torch.cat([self.user_emb(user), h], -1)), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, num_items, dim):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, item):
        return F.normalize(self.mlp(self.item_emb(item)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, num_users, num_items, dim):
        super().__init__()
        self.user_tower = UserTower(num_users, num_items, dim)
        self.item_tower = ItemTower(num_items, dim)

    def forward(self, user, hist, item):
        return self.user_tower(user, hist), self.item_tower(item)


class StreamingFrequency:
    """Hash-free version of the streaming frequency estimator: step gaps per item."""

    def __init__(self, num_items, device, alpha=0.01):
        self.last = torch.zeros(num_items + 1, device=device)
        self.gap = torch.full((num_items + 1,), 1e4, device=device)
        self.alpha = alpha

    def update(self, items, step):
        items = items.unique()
        self.gap[items] = (1 - self.alpha) * self.gap[items] + self.alpha * (step - self.last[items])
        self.last[items] = float(step)

    def log_q(self, items):
        return -torch.log(self.gap[items].clamp(min=1.0))


def in_batch_loss(u, v, item_ids, freq, temperature):
    # v and item ids from every rank; gradient flows back to the local shard
    v_all = torch.cat(dist_fn.all_gather(v), dim=0)
    ids_all = [torch.empty_like(item_ids) for _ in range(dist.get_world_size())]
    dist.all_gather(ids_all, item_ids)
    ids_all = torch.cat(ids_all)
    logits = u @ v_all.t() / temperature
    logits = logits - freq.log_q(ids_all).unsqueeze(0)
    # same item clicked twice in the global batch is not a negative
    dup = item_ids.unsqueeze(1) == ids_all.unsqueeze(0)
    offset = dist.get_rank() * u.size(0)
    labels = torch.arange(u.size(0), device=u.device) + offset
    dup[torch.arange(u.size(0)), labels] = False
    logits = logits.masked_fill(dup, float("-inf"))
    return F.cross_entropy(logits, labels), ids_all


@torch.no_grad()
def evaluate(model, loader, num_items, topk, device):
    net = model.module
    net.eval()
    all_items = torch.arange(1, num_items + 1, device=device)
    item_vecs = torch.cat([net.item_tower(chunk) for chunk in all_items.split(65536)])
    hits = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for user, hist, item in loader:
        user, hist, item = user.to(device), hist.to(device), item.to(device)
        scores = net.user_tower(user, hist) @ item_vecs.t()
        top = scores.topk(topk, dim=1).indices + 1
        hits += (top == item.unsqueeze(1)).any(1).float().sum()
        count += user.size(0)
    dist.all_reduce(hits)
    dist.all_reduce(count)
    net.train()
    return (hits / count).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    train_ds = ClickPairs(args.train, args.hist_len)
    val_ds = ClickPairs(args.val, args.hist_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # no padding for eval: each rank takes a strided slice
    val_idx = list(range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=2048,
                            num_workers=4, pin_memory=True)

    model = TwoTower(args.num_users, args.num_items, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    freq = StreamingFrequency(args.num_items, device)

    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for user, hist, item in train_loader:
            user = user.to(device, non_blocking=True)
            hist = hist.to(device, non_blocking=True)
            item = item.to(device, non_blocking=True)
            u, v = model(user, hist, item)
            loss, ids_all = in_batch_loss(u, v, item, freq, args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # every rank sees the same global ids, so the estimator stays identical
            freq.update(ids_all, step)
            step += 1
            if step % 200 == 0 and writer is not None:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/items_per_s",
                                  200 * args.batch_size * world / (time.time() - t0), step)
                t0 = time.time()

        recall = evaluate(model, val_loader, args.num_items, args.topk, device)
        if rank == 0:
            print(f"epoch {epoch}: recall@{args.topk} = {recall:.4f}", flush=True)
            writer.add_scalar(f"val/recall@{args.topk}", recall, step)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "step": step},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
