"""Two-tower candidate retrieval (user tower / item tower) trained with in-batch softmax.

Data: interactions parquet with user_id, item_id, hist (list of last 50 item ids), ts.
Items: parquet with item_id, category_id, brand_id.

    deepspeed --num_gpus 8 08_two_tower_retrieval.py --data /data/retail --epochs 10
"""
import argparse
import math
import os
import time

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST_LEN = 50


class Interactions(Dataset):
    def __init__(self, path):
        df = pd.read_parquet(path)
        self.user = df["user_id"].to_numpy(np.int64)
        self.item = df["item_id"].to_numpy(np.int64)
        hist = np.zeros((len(df), HIST_LEN), dtype=np.int64)  # 0 = padding
        for i, h in enumerate(df["hist"]):
            h = np.asarray(h[-HIST_LEN:], dtype=np.int64)
            hist[i, HIST_LEN - len(h):] = h
        self.hist = hist

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        return self.user[i], self.hist[i], self.item[i]


class ItemTower(nn.Module):
    def __init__(self, n_items, n_cats, n_brands, dim):
        super().__init__()
        self.item = nn.Embedding(n_items, dim, padding_idx=0)
        self.cat = nn.Embedding(n_cats, dim // 4)
        self.brand = nn.Embedding(n_brands, dim // 4)
        self.mlp = nn.Sequential(nn.Linear(dim + dim // 2, 512), nn.GELU(), nn.Linear(512, dim))

    def forward(self, item_ids, cat_ids, brand_ids):
        x = torch.cat([self.item(item_ids), self.cat(cat_ids), self.brand(brand_ids)], dim=-1)
        return F.normalize(self.mlp(x), dim=-1)


class UserTower(nn.Module):
    def __init__(self, n_users, item_emb, dim):
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.item_emb = item_emb  # shared with the item tower
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 512), nn.GELU(), nn.Linear(512, dim))

    def forward(self, user_ids, hist):
        mask = (hist > 0).unsqueeze(-1).to(self.user.weight.dtype)
        h = (self.item_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return F.normalize(self.mlp(torch.cat([self.user(user_ids), h], dim=-1)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_cats, n_brands, item_cat, item_brand, dim=128, temp=0.05):
        super().__init__()
        self.items = ItemTower(n_items, n_cats, n_brands, dim)
        self.users = UserTower(n_users, self.items.item, dim)
        self.register_buffer("item_cat", item_cat, persistent=False)
        self.register_buffer("item_brand", item_brand, persistent=False)
        self.temp = temp

    def encode_items(self, item_ids):
        return self.items(item_ids, self.item_cat[item_ids], self.item_brand[item_ids])

    def forward(self, user_ids, hist, pos_items):
        u = self.users(user_ids, hist)
        v = self.encode_items(pos_items)
        logits = u @ v.t() / self.temp
        labels = torch.arange(u.size(0), device=u.device)
        return F.cross_entropy(logits.float(), labels)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--topk", type=int, default=50)
    ap.add_argument("--out", default="runs/two_tower")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


@torch.no_grad()
def recall_at_k(engine, loader, n_items, k):
    engine.eval()
    model = engine.module
    all_items = torch.arange(n_items, device=engine.device)
    item_vecs = torch.cat([model.encode_items(chunk) for chunk in all_items.split(65536)])
    hits, total = 0, 0
    for user, hist, target in loader:
        u = model.users(user.to(engine.device), hist.to(engine.device))
        topk = (u @ item_vecs.t()).topk(k, dim=-1).indices
        hits += (topk == target.to(engine.device).unsqueeze(1)).any(1).sum().item()
        total += user.numel()
    engine.train()
    return hits / max(total, 1)


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    items = pd.read_parquet(os.path.join(args.data, "items.parquet")).sort_values("item_id")
    n_items = int(items["item_id"].max()) + 1
    item_cat = torch.zeros(n_items, dtype=torch.long)
    item_brand = torch.zeros(n_items, dtype=torch.long)
    item_cat[items["item_id"].to_numpy()] = torch.from_numpy(items["category_id"].to_numpy(np.int64))
    item_brand[items["item_id"].to_numpy()] = torch.from_numpy(items["brand_id"].to_numpy(np.int64))

    train_set = Interactions(os.path.join(args.data, "train.parquet"))
    valid_set = Interactions(os.path.join(args.data, "valid.parquet"))
    n_users = int(max(train_set.user.max(), valid_set.user.max())) + 1

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=512, num_workers=4,
                              sampler=DistributedSampler(valid_set, shuffle=False))

    model = TwoTower(n_users, n_items, int(item_cat.max()) + 1, int(item_brand.max()) + 1,
                     item_cat, item_brand, dim=args.dim)
    steps = len(train_loader) * args.epochs
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-6}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": min(2000, steps // 10), "total_num_steps": steps}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    best = -math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (user, hist, item) in enumerate(train_loader):
            loss = engine(user.to(engine.device), hist.to(engine.device), item.to(engine.device))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        rec = recall_at_k(engine, valid_loader, n_items, args.topk)
        if rank == 0:
            print(f"epoch {epoch}: valid recall@{args.topk} = {rec:.4f}", flush=True)

        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        if rank == 0 and rec > best:
            best = rec
            torch.save({"state_dict": engine.module.state_dict(), "dim": args.dim, "n_items": n_items,
                        "n_users": n_users, "recall": rec}, os.path.join(args.out, "two_tower_best.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
