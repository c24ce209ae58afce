"""
Two-tower candidate retrieval (user tower / item tower) trained with in-batch sampled softmax.
Input: a directory of parquet shards with columns user_id, item_id, ts, item_category.
Each rank reads its own subset of the shards.

    torchrun --nproc_per_node=8 11_two_tower_retrieval.py --data /data/interactions --epochs 5
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distnn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def load_shards(paths):
    df = pd.concat([pd.read_parquet(p, columns=["user_id", "item_id", "ts", "item_category"]) for p in paths])
    return df.sort_values(["user_id", "ts"]).reset_index(drop=True)


def build_vocab(values):
    uniq = np.unique(values)
    return {v: i + 1 for i, v in enumerate(uniq)}  # 0 = padding / OOV


class HistoryDataset(Dataset):
    """(user, last-k history) -> next item."""

    def __init__(self, df, user_vocab, item_vocab, cat_vocab, hist_len=20):
        self.samples = []
        self.hist_len = hist_len
        item_cat = dict(zip(df["item_id"], df["item_category"]))
        for uid, g in df.groupby("user_id", sort=False):
            items = [item_vocab.get(i, 0) for i in g["item_id"].tolist()]
            u = user_vocab.get(uid, 0)
            for t in range(1, len(items)):
                hist = items[max(0, t - hist_len):t]
                self.samples.append((u, hist, items[t]))
        self.item_cat = {item_vocab[k]: cat_vocab.get(v, 0) for k, v in item_cat.items() if k in item_vocab}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        u, hist, target = self.samples[i]
        h = np.zeros(self.hist_len, dtype=np.int64)
        h[-len(hist):] = hist
        return u, torch.from_numpy(h), target, self.item_cat.get(target, 0)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_cats, dim=128):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, dim)
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=0)
        self.cat_emb = nn.Embedding(n_cats, 32)
        self.user_mlp = nn.Sequential(nn.Linear(2 * dim, 512), nn.GELU(), nn.Linear(512, dim))
        self.item_mlp = nn.Sequential(nn.Linear(dim + 32, 512), nn.GELU(), nn.Linear(512, dim))
        self.log_temp = nn.Parameter(torch.tensor(np.log(0.05), dtype=torch.float32))

    def user_vec(self, u, hist):
        h = self.item_emb(hist)
        mask = (hist > 0).unsqueeze(-1).float()
        h = (h * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(self.user_mlp(torch.cat([self.user_emb(u), h], -1)), dim=-1)

    def item_vec(self, item, cat):
        return F.normalize(self.item_mlp(torch.cat([self.item_emb(item), self.cat_emb(cat)], -1)), dim=-1)

    def forward(self, u, hist, item, cat):
        return self.user_vec(u, hist), self.item_vec(item, cat), self.log_temp.exp()


def in_batch_softmax(uv, iv, temp):
    # negatives = items of every rank's batch
    all_items = torch.cat(distnn.all_gather(iv), dim=0)
    logits = uv @ all_items.t() / temp
    labels = torch.arange(uv.size(0), device=uv.device) + dist.get_rank() * uv.size(0)
    return F.cross_entropy(logits, labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", default="ckpt/two_tower.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    shards = sorted(glob.glob(os.path.join(args.data, "*.parquet")))
    my_shards = shards[rank::world]
    df = load_shards(my_shards)
    cutoff = df["ts"].quantile(0.95)
    train_df, val_df = df[df["ts"] <= cutoff], df[df["ts"] > cutoff]

    user_vocab = build_vocab(df["user_id"].values)
    item_vocab = build_vocab(df["item_id"].values)
    cat_vocab = build_vocab(df["item_category"].values)

    train_ds = HistoryDataset(train_df, user_vocab, item_vocab, cat_vocab)
    val_ds = HistoryDataset(val_df, user_vocab, item_vocab, cat_vocab)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=2, drop_last=True)

    # shards differ in size, so every rank runs the step count of the smallest one
    n_steps = torch.tensor([len(loader)], device=device)
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(n_steps.item())
    n_val = torch.tensor([len(val_loader)], device=device)
    dist.all_reduce(n_val, op=dist.ReduceOp.MIN)
    val_steps = int(n_val.item())

    model = TwoTower(len(user_vocab) + 1, len(item_vocab) + 1, len(cat_vocab) + 1, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * (args.batch_size * world / 1024) ** 0.5)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        it = iter(loader)
        total = torch.zeros(1, device=device)
        for step in range(steps_per_epoch):
            u, hist, item, cat = next(it)
            u, hist, item, cat = (x.to(device, non_blocking=True) for x in (u, hist, item, cat))
            uv, iv, temp = model(u, hist, item, cat)
            loss = in_batch_softmax(uv, iv, temp)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            if step % 100 == 0 and rank == 0:
                print(f"epoch {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f}", flush=True)

        # in-batch recall@10 on held-out interactions (same candidate pool as training)
        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            vit = iter(val_loader)
            for _ in range(val_steps):
                u, hist, item, cat = (x.to(device) for x in next(vit))
                uv, iv, _ = model.module(u, hist, item, cat)
                all_iv = torch.cat(distnn.all_gather(iv), 0)
                top = (uv @ all_iv.t()).topk(10, dim=1).indices
                target = torch.arange(uv.size(0), device=device) + rank * uv.size(0)
                hits[0] += (top == target[:, None]).any(1).sum()
                hits[1] += uv.size(0)
        dist.all_reduce(hits)
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch}: train loss {total.item() / steps_per_epoch:.4f} "
                  f"recall@10 {(hits[0] / hits[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
