"""Two-tower retrieval model trained with cross-rank in-batch negatives.

Training data: click pairs (user_id, hist_item_ids, item_id, item_cat_id) in parquet.
Each rank scores its queries against the items of *all* ranks, with a logQ
correction for the popularity bias of in-batch sampling.
"""
import argparse
import glob
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/fsx/recsys/clicks_v3")
    ap.add_argument("--out", default="/mnt/fsx/recsys/ckpt/two_tower")
    ap.add_argument("--num_users", type=int, default=2_000_000)
    ap.add_argument("--num_items", type=int, default=800_000)
    ap.add_argument("--num_cats", type=int, default=5000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--max_hist", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=4096, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def pad_hist(lists, max_len):
    out = np.zeros((len(lists), max_len), dtype=np.int64)  # 0 = padding item
    for i, h in enumerate(lists):
        h = h[-max_len:]
        out[i, : len(h)] = h
    return out


class ClickPairs(Dataset):
    def __init__(self, files, max_hist):
        df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        self.user = df["user_id"].to_numpy(np.int64)
        self.hist = pad_hist(df["hist_item_ids"].tolist(), max_hist)
        self.item = df["item_id"].to_numpy(np.int64)
        self.cat = df["item_cat_id"].to_numpy(np.int64)

    def __len__(self):
        return len(self.item)

    def __getitem__(self, i):
        return self.user[i], self.hist[i], self.item[i], self.cat[i]


class UserTower(nn.Module):
    def __init__(self, num_users, num_items, dim):
        super().__init__()
        self.user_emb = nn.Embedding(num_users, dim)
        self.hist_emb = nn.EmbeddingBag(num_items, dim, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 512), nn.ReLU(), nn.Linear(512, dim))

    def forward(self, user, hist):
        x = torch.cat([self.user_emb(user), self.hist_emb(hist)], dim=-1)
        return F.normalize(self.mlp(x), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, num_items, num_cats, dim):
        super().__init__()
        self.item_emb = nn.Embedding(num_items, dim)
        self.cat_emb = nn.Embedding(num_cats, dim // 4)
        self.mlp = nn.Sequential(nn.Linear(dim + dim // 4, 512), nn.ReLU(), nn.Linear(512, dim))

    def forward(self, item, cat):
        x = torch.cat([self.item_emb(item), self.cat_emb(cat)], dim=-1)
        return F.normalize(self.mlp(x), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.user_tower = UserTower(a.num_users, a.num_items, a.dim)
        self.item_tower = ItemTower(a.num_items, a.num_cats, a.dim)

    def forward(self, user, hist, item, cat):
        return self.user_tower(user, hist), self.item_tower(item, cat)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.parquet")))
    train_ds = ClickPairs(train_files, args.max_hist)

    # item frequency for the logQ correction -- same file list on every rank, so same counts
    counts = np.bincount(train_ds.item, minlength=args.num_items).astype(np.float64)
    log_q = torch.tensor(np.log((counts + 1.0) / (counts.sum() + args.num_items)),
                         dtype=torch.float32, device=device)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    torch.manual_seed(17)
    model = TwoTower(args).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    items_df = pd.read_parquet(os.path.join(args.data, "items.parquet"))
    corpus_item = torch.from_numpy(items_df["item_id"].to_numpy(np.int64)).to(device)
    corpus_cat = torch.from_numpy(items_df["item_cat_id"].to_numpy(np.int64)).to(device)

    val_df = pd.read_parquet(os.path.join(args.data, "val.parquet"))
    val_df = val_df.iloc[rank::world]  # eval shard, no padding
    val_user = torch.from_numpy(val_df["user_id"].to_numpy(np.int64))
    val_hist = torch.from_numpy(pad_hist(val_df["hist_item_ids"].tolist(), args.max_hist))
    val_target = torch.from_numpy(val_df["item_id"].to_numpy(np.int64))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for user, hist, item, cat in loader:
            user, hist = user.to(device, non_blocking=True), hist.to(device, non_blocking=True)
            item, cat = item.to(device, non_blocking=True), cat.to(device, non_blocking=True)

            u, v = model(user, hist, item, cat)
            # gather items from every rank; grads flow back to the owning rank
            all_v = torch.cat(dist_nn.all_gather(v), dim=0)
            all_item = [torch.empty_like(item) for _ in range(world)]
            dist.all_gather(all_item, item)
            all_item = torch.cat(all_item)

            logits = u @ all_v.t() / args.temperature - log_q[all_item].unsqueeze(0)
            # mask accidental hits: same item id as the positive but a different column
            same = item.unsqueeze(1) == all_item.unsqueeze(0)
            B = u.size(0)
            labels = torch.arange(B, device=device) + rank * B
            same[torch.arange(B, device=device), labels] = False
            logits = logits.masked_fill(same, float("-inf"))
            loss = F.cross_entropy(logits, labels)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d loss %.4f", epoch, step, l.item())

        recall = evaluate(model.module, corpus_item, corpus_cat, val_user, val_hist, val_target,
                          args.topk, device)
        log.info("epoch %d recall@%d %.4f", epoch, args.topk, recall)

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "opt": opt.state_dict()}, os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


@torch.no_grad()
def evaluate(net, corpus_item, corpus_cat, users, hists, targets, k, device, chunk=8192):
    net.eval()
    item_vecs = torch.cat([net.item_tower(corpus_item[i:i + chunk], corpus_cat[i:i + chunk])
                           for i in range(0, corpus_item.numel(), chunk)])
    hits = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(0, users.numel(), chunk):
        u = net.user_tower(users[i:i + chunk].to(device), hists[i:i + chunk].to(device))
        top = (u @ item_vecs.t()).topk(k, dim=1).indices
        top_ids = corpus_item[top]
        tgt = targets[i:i + chunk].to(device).unsqueeze(1)
        hits[0] += (top_ids == tgt).any(dim=1).sum()
        hits[1] += tgt.size(0)
    dist.all_reduce(hits)
    net.train()
    return (hits[0] / hits[1]).item()


if __name__ == "__main__":
    main()
