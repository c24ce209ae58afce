# -*- coding: utf-8 -*-
"""
BERT4Rec on RetailRocket (view / addtocart / transaction events, 5-core).

    torchrun --nproc_per_node=4 18_bert4rec_retailrocket.py --events data/retailrocket/events.csv
"""
import argparse
import logging
import math
import os
import random
import sys
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("b4r")


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--save_to", default="models/b4r_retailrocket")
    ap.add_argument("--max_len", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--n_layers", type=int, default=2)
    ap.add_argument("--n_heads", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--mask_prob", type=float, default=0.3)
    ap.add_argument("--batch_size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--num_neg", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def load_events(path):
    df = pd.read_csv(path, usecols=["timestamp", "visitorid", "itemid"])
    df = df.drop_duplicates(["visitorid", "itemid"], keep="first")
    for _ in range(10):
        ic = df.groupby("itemid")["visitorid"].transform("size")
        uc = df.groupby("visitorid")["itemid"].transform("size")
        keep = (ic >= 5) & (uc >= 5)
        if keep.all():
            break
        df = df[keep]
    df["iid"] = pd.factorize(df["itemid"], sort=True)[0] + 1
    df = df.sort_values(["visitorid", "timestamp"], kind="mergesort")
    seqs = df.groupby("visitorid", sort=True)["iid"].agg(list).tolist()
    return seqs, int(df["iid"].max())


class ClozeTrain(Dataset):
    def __init__(self, seqs, n_items, max_len, mask_prob):
        self.seqs = [s[:-2] for s in seqs]
        self.n_items = n_items
        self.mask_id = n_items + 1
        self.max_len = max_len
        self.mask_prob = mask_prob

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        s = np.asarray(self.seqs[idx][-self.max_len:], dtype=np.int64)
        masked = np.random.rand(len(s)) < self.mask_prob
        masked[-1] |= not masked.any()
        tokens = np.where(masked, self.mask_id, s)
        labels = np.where(masked, s, 0)
        out_t = np.zeros(self.max_len, dtype=np.int64)
        out_l = np.zeros(self.max_len, dtype=np.int64)
        out_t[-len(s):], out_l[-len(s):] = tokens, labels
        return torch.from_numpy(out_t), torch.from_numpy(out_l)


class BERT4Rec(nn.Module):
    def __init__(self, n_items, max_len, hidden, n_layers, n_heads, dropout):
        super().__init__()
        self.item_embeddings = nn.Embedding(n_items + 2, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_len, hidden)
        self.emb_norm = nn.LayerNorm(hidden)
        self.emb_dropout = nn.Dropout(dropout)
        self.layers = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, n_heads, 4 * hidden, dropout, activation="gelu", batch_first=True),
            n_layers)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.n_items = n_items

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        h = self.emb_dropout(self.emb_norm(self.item_embeddings(tokens) + self.position_embeddings(pos)))
        h = self.layers(h, src_key_padding_mask=tokens == 0)
        h = self.head(h)
        # tied weights over the real items (index 0 = padding never wins after masking)
        return h @ self.item_embeddings.weight[: self.n_items + 1].t()


@torch.no_grad()
def evaluate(net, seqs, users, n_items, max_len, n_neg, split, device, seed):
    net.eval()
    rng = np.random.default_rng(seed)
    mask_id = n_items + 1
    s_hr = torch.zeros((), device=device, dtype=torch.float64)
    s_ndcg = torch.zeros_like(s_hr)
    count = torch.zeros_like(s_hr)
    for b in range(0, len(users), 512):
        us = users[b:b + 512]
        toks = np.zeros((len(us), max_len), dtype=np.int64)
        cands = np.zeros((len(us), n_neg + 1), dtype=np.int64)
        for r, u in enumerate(us):
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            inp = (hist + [mask_id])[-max_len:]
            toks[r, max_len - len(inp):] = inp
            seen = set(s)
            negs = []
            while len(negs) < n_neg:
                c = int(rng.integers(1, n_items + 1))
                if c not in seen:
                    negs.append(c)
            cands[r] = [tgt] + negs
        t = torch.from_numpy(toks).to(device)
        c = torch.from_numpy(cands).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(t)[:, -1]
        sc = logits.float().gather(1, c)
        rank = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        hit = (rank < 10).double()
        s_hr += hit.sum()
        s_ndcg += (hit / torch.log2(rank + 2)).sum()
        count += len(us)
    stats = torch.stack([s_hr, s_ndcg, count])
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, n_items = load_events(args.events)
    logger.info("visitors=%d items=%d", len(seqs), n_items)

    train_set = ClozeTrain(seqs, n_items, args.max_len, args.mask_prob)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=4, pin_memory=True, drop_last=True)

    net = BERT4Rec(n_items, args.max_len, args.hidden, args.n_layers, args.n_heads, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * math.sqrt(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)

    eval_users = list(range(rank, len(seqs), world_size))
    if rank == 0:
        os.makedirs(args.save_to, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for tokens, labels in train_loader:
            tokens, labels = tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_meter)

        hr, ndcg = evaluate(net, seqs, eval_users, n_items, args.max_len, args.num_neg, "valid", device,
                            seed=epoch * 131 + rank)
        logger.info("epoch %d loss %.4f valid HR@10 %.4f NDCG@10 %.4f (%.0fs)", epoch,
                    (loss_meter[0] / loss_meter[1]).item(), hr, ndcg, time.time() - t0)
        if ndcg > best:
            best = ndcg
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "n_items": n_items},
                           os.path.join(args.save_to, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.save_to, "best.pt"), map_location=device)
    net.load_state_dict(ckpt["model"])
    hr, ndcg = evaluate(net, seqs, eval_users, n_items, args.max_len, args.num_neg, "test", device, seed=7 + rank)
    logger.info("test (best epoch %d) HR@10 %.4f NDCG@10 %.4f", ckpt["epoch"], hr, ndcg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
