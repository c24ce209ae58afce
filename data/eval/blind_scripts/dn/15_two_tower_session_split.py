"""Session-aware two-tower retrieval for the marketplace home feed.

Query tower: user id + mean of the last N items viewed in the session.
Candidate tower: item id + shop id + price bucket.
Random 2% of the interactions are held out for recall@K / MRR.

    torchrun --nproc_per_node=8 15_two_tower_session_split.py \
        --interactions /data/market/interactions_30d.parquet --items /data/market/items.parquet
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("session_tt")
MAX_SESSION = 20


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def to_session_matrix(sessions, max_len=MAX_SESSION):
    out = np.zeros((len(sessions), max_len), dtype=np.int64)
    for i, s in enumerate(sessions):
        s = list(s)[-max_len:]
        if s:
            out[i, -len(s):] = s
    return out


class Interactions(Dataset):
    def __init__(self, df, items):
        self.user = df["user_id"].to_numpy(np.int64)
        self.session = to_session_matrix(df["session_items"].tolist())
        self.item = df["item_id"].to_numpy(np.int64)
        self.shop = items["shop_id"].to_numpy(np.int64)[self.item]
        self.price = items["price_bucket"].to_numpy(np.int64)[self.item]

    def __len__(self):
        return len(self.item)

    def __getitem__(self, i):
        return self.user[i], self.session[i], self.item[i], self.shop[i], self.price[i]


class SessionTwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_shops, n_price, dim):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, dim)
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=0)
        self.shop_emb = nn.Embedding(n_shops, dim // 2)
        self.price_emb = nn.Embedding(n_price, 8)
        self.q_proj = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, dim))
        self.c_proj = nn.Sequential(nn.Linear(dim + dim // 2 + 8, 256), nn.ReLU(), nn.Linear(256, dim))

    def query(self, user, session):
        mask = (session > 0).float().unsqueeze(-1)
        s = (self.item_emb(session) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(self.q_proj(torch.cat([self.user_emb(user), s], -1)), dim=-1)

    def candidate(self, item, shop, price):
        x = torch.cat([self.item_emb(item), self.shop_emb(shop), self.price_emb(price)], -1)
        return F.normalize(self.c_proj(x), dim=-1)

    def forward(self, user, session, item, shop, price):
        return self.query(user, session), self.candidate(item, shop, price)


@torch.no_grad()
def evaluate(net, val_ds, items, device, rank, world, k=50, bs=4096):
    net.eval()
    ids = torch.arange(len(items), device=device)
    shop = torch.from_numpy(items["shop_id"].to_numpy(np.int64)).to(device)
    price = torch.from_numpy(items["price_bucket"].to_numpy(np.int64)).to(device)
    cand = torch.cat([net.candidate(ids[i:i + 65536], shop[i:i + 65536], price[i:i + 65536])
                      for i in range(0, len(ids), 65536)])
    idx = np.arange(rank, len(val_ds), world)
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # hits, reciprocal rank sum, count
    for s in range(0, len(idx), bs):
        j = idx[s:s + bs]
        q = net.query(torch.from_numpy(val_ds.user[j]).to(device), torch.from_numpy(val_ds.session[j]).to(device))
        top = (q @ cand.t()).topk(k, -1).indices
        tgt = torch.from_numpy(val_ds.item[j]).to(device).unsqueeze(1)
        match = top == tgt
        found = match.any(1)
        pos = match.float().argmax(1)
        stats[0] += found.sum()
        stats[1] += (found.double() / (pos.double() + 1)).sum()
        stats[2] += len(j)
    dist.all_reduce(stats)
    net.train()
    return {"recall": (stats[0] / stats[2]).item(), "mrr": (stats[1] / stats[2]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--interactions", required=True)
    ap.add_argument("--items", required=True)
    ap.add_argument("--out", default="/data/market/runs/session_tt")
    ap.add_argument("--n_users", type=int, default=8_000_000)
    ap.add_argument("--n_shops", type=int, default=400_000)
    ap.add_argument("--n_price", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--val_frac", type=float, default=0.02)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    # different dropout / augmentation streams per rank
    set_seed(args.seed + rank)

    items = pd.read_parquet(args.items, columns=["item_id", "shop_id", "price_bucket"]).sort_values("item_id")
    assert (items["item_id"].to_numpy() == np.arange(len(items))).all(), "item ids must be 0..n-1"
    df = pd.read_parquet(args.interactions, columns=["user_id", "session_items", "item_id"])
    perm = np.random.permutation(len(df))
    n_val = int(len(df) * args.val_frac)
    val_df, train_df = df.iloc[perm[:n_val]], df.iloc[perm[n_val:]]
    train_ds, val_ds = Interactions(train_df, items), Interactions(val_df, items)
    del df, train_df, val_df
    logger.info("train %d val %d items %d", len(train_ds), len(val_ds), len(items))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    model = SessionTwoTower(args.n_users, len(items), args.n_shops, args.n_price, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (user, sess, item, shop, price) in enumerate(loader, 1):
            user, sess = user.to(device, non_blocking=True), sess.to(device, non_blocking=True)
            item, shop, price = item.to(device, non_blocking=True), shop.to(device, non_blocking=True), \
                price.to(device, non_blocking=True)
            q, c = model(user, sess, item, shop, price)
            logits = q @ c.t() / args.tau
            dup = (item[:, None] == item[None, :]) & ~torch.eye(len(item), dtype=torch.bool, device=device)
            loss = F.cross_entropy(logits.masked_fill(dup, -1e4), torch.arange(len(item), device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.4f (%.0f ms/it)", epoch, step, len(loader), l.item(),
                            (time.time() - t0) * 5)
                t0 = time.time()

        m = evaluate(model.module, val_ds, items, device, rank, world)
        logger.info("epoch %d recall@50 %.4f mrr@50 %.4f", epoch, m["recall"], m["mrr"])
        if rank == 0:
            state = {"model": model.module.state_dict(), "epoch": epoch, "metrics": m}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if m["recall"] > best:
                best = m["recall"]
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
