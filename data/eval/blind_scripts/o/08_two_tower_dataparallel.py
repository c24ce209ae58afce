# Two-tower retrieval model (user tower / item tower) with in-batch sampled softmax.
# Single node, 4 GPUs through nn.DataParallel; logQ correction for item popularity.
#
#   CUDA_VISIBLE_DEVICES=0,1,2,3 python 08_two_tower_dataparallel.py --data /data/rec/clicks.parquet
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
logger = logging.getLogger(__name__)

HIST_LEN = 50


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/rec/clicks.parquet")
    ap.add_argument("--n-users", type=int, default=5_000_000)
    ap.add_argument("--n-items", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--save", default="ckpt/two_tower.pt")
    return ap.parse_args()


class ClickLog(Dataset):
    def __init__(self, path):
        df = pd.read_parquet(path, columns=["user_id", "item_id", "hist", "item_cat"])
        self.user = df.user_id.values.astype(np.int64)
        self.item = df.item_id.values.astype(np.int64)
        self.cat = df.item_cat.values.astype(np.int64)
        self.hist = np.zeros((len(df), HIST_LEN), dtype=np.int64)
        for i, h in enumerate(df.hist.values):
            h = h[-HIST_LEN:]
            self.hist[i, :len(h)] = np.asarray(h) + 1  # 0 = padding
        counts = np.bincount(self.item, minlength=self.item.max() + 1).astype(np.float64)
        self.item_logq = np.log(counts / counts.sum() + 1e-12).astype(np.float32)

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        item = self.item[i]
        return self.user[i], self.hist[i], item, self.cat[i], self.item_logq[item]


class UserTower(nn.Module):
    def __init__(self, n_users, n_items, dim):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, dim)
        self.hist_emb = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, user, hist):
        mask = (hist > 0).float().unsqueeze(-1)
        h = (self.hist_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(self.mlp(torch.cat([self.user_emb(user), h], -1)), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, n_items, n_cats, dim):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim)
        self.cat_emb = nn.Embedding(n_cats, 16)
        self.mlp = nn.Sequential(nn.Linear(dim + 16, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, item, cat):
        return F.normalize(self.mlp(torch.cat([self.item_emb(item), self.cat_emb(cat)], -1)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_cats, dim, temperature):
        super().__init__()
        self.user_tower = UserTower(n_users, n_items, dim)
        self.item_tower = ItemTower(n_items, n_cats, dim)
        self.temperature = temperature

    def forward(self, user, hist, item, cat, logq):
        u = self.user_tower(user, hist)
        v = self.item_tower(item, cat)
        logits = u @ v.t() / self.temperature - logq.unsqueeze(0)
        # the same item may appear twice in a batch; don't treat it as a negative
        same = item.unsqueeze(0) == item.unsqueeze(1)
        eye = torch.eye(len(item), dtype=torch.bool, device=item.device)
        logits = logits.masked_fill(same & ~eye, float("-inf"))
        labels = torch.arange(len(item), device=item.device)
        loss = F.cross_entropy(logits, labels)
        return loss


@torch.no_grad()
def recall_at_k(model, loader, device, k=50, max_batches=50):
    net = model.module if isinstance(model, nn.DataParallel) else model
    net.eval()
    hits, total = 0, 0
    for bi, (user, hist, item, cat, _) in enumerate(loader):
        if bi >= max_batches:
            break
        user, hist, item, cat = user.to(device), hist.to(device), item.to(device), cat.to(device)
        u = net.user_tower(user, hist)
        v = net.item_tower(item, cat)
        scores = u @ v.t()
        topk = scores.topk(min(k, scores.shape[1]), dim=1).indices
        hits += (topk == torch.arange(len(item), device=device)[:, None]).any(1).sum().item()
        total += len(item)
    net.train()
    return hits / max(total, 1)


def main():
    args = get_args()
    device = torch.device("cuda:0")
    ds = ClickLog(args.data)
    n_cats = int(ds.cat.max()) + 1
    n_val = min(200_000, len(ds) // 50)
    train_ds, val_ds = torch.utils.data.random_split(ds, [len(ds) - n_val, n_val],
                                                     generator=torch.Generator().manual_seed(0))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=16,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4096, shuffle=False, num_workers=4)

    model = TwoTower(args.n_users, args.n_items, n_cats, args.dim, args.temperature)
    model = model.to(device)
    if torch.cuda.device_count() > 1:
        logger.info("using %d GPUs with DataParallel", torch.cuda.device_count())
        model = nn.DataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for user, hist, item, cat, logq in train_loader:
            user, hist = user.to(device, non_blocking=True), hist.to(device, non_blocking=True)
            item, cat, logq = item.to(device, non_blocking=True), cat.to(device, non_blocking=True), \
                logq.to(device, non_blocking=True)
            loss = model(user, hist, item, cat, logq)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f %.0f samples/s", epoch, step, loss.item(),
                            200 * args.batch_size / (time.time() - t0))
                t0 = time.time()
        r = recall_at_k(model, val_loader, device)
        logger.info("epoch %d in-batch recall@50 %.4f", epoch, r)
        os.makedirs(os.path.dirname(args.save), exist_ok=True)
        state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
        torch.save({"model": state, "epoch": epoch, "args": vars(args)}, args.save)


if __name__ == "__main__":
    main()
