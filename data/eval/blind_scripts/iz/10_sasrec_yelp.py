#!/usr/bin/env python3
"""SASRec baseline for Yelp (reviews since 2019-01-01, 10-core).

torchrun --nproc_per_node=4 10_sasrec_yelp.py --reviews data/yelp/review.jsonl --workdir exp/yelp_sasrec
"""
import argparse
import json
import logging
import math
import os
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

LOG = logging.getLogger("yelp_sasrec")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--reviews", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--since", default="2019-01-01")
    p.add_argument("--core", type=int, default=10)
    p.add_argument("--max_seq_len", type=int, default=50)
    p.add_argument("--emb", type=int, default=64)
    p.add_argument("--n_blocks", type=int, default=2)
    p.add_argument("--n_heads", type=int, default=2)
    p.add_argument("--p_drop", type=float, default=0.5)
    p.add_argument("--global_batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_yelp(path, since, core):
    df = pd.read_json(path, lines=True, dtype={"user_id": str, "business_id": str})[["user_id", "business_id", "date"]]
    df["date"] = pd.to_datetime(df["date"])
    df = df[df["date"] >= since]
    for _ in range(20):
        uc = df["user_id"].map(df["user_id"].value_counts())
        ic = df["business_id"].map(df["business_id"].value_counts())
        mask = (uc >= core) & (ic >= core)
        if mask.all():
            break
        df = df[mask]
    df["item"] = pd.factorize(df["business_id"], sort=True)[0] + 1
    df = df.sort_values(["user_id", "date"], kind="mergesort")
    seqs = df.groupby("user_id", sort=True)["item"].agg(list).tolist()
    return seqs, int(df["item"].max())


class YelpTrain(Dataset):
    def __init__(self, seqs, n_items, max_len, seed):
        self.seqs = [s[:-2] for s in seqs]
        self.n_items = n_items
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, idx):
        s = self.seqs[idx]
        x = s[:-1][-self.max_len:]
        y = s[1:][-self.max_len:]
        seen = np.asarray(sorted(set(s)))
        neg = np.random.randint(1, self.n_items + 1, size=len(y))
        clash = np.isin(neg, seen)
        while clash.any():
            neg[clash] = np.random.randint(1, self.n_items + 1, size=int(clash.sum()))
            clash = np.isin(neg, seen)
        out = np.zeros((3, self.max_len), dtype=np.int64)
        n = len(x)
        out[0, -n:], out[1, -n:], out[2, -n:] = x, y, neg
        return torch.from_numpy(out)


class SASRec(nn.Module):
    def __init__(self, n_items, max_len, d, n_blocks, n_heads, p):
        super().__init__()
        self.items = nn.Embedding(n_items + 1, d, padding_idx=0)
        self.positions = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(p)
        enc_layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, p, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, n_blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.items.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        with torch.no_grad():
            self.items.weight[0].zero_()

    def encode(self, x):
        L = x.size(1)
        h = self.items(x) + self.positions(torch.arange(L, device=x.device))[None]
        h = self.drop(h) * (x > 0).unsqueeze(-1)
        attn_mask = torch.full((L, L), float("-inf"), device=x.device).triu(1)
        return self.norm(self.encoder(h, mask=attn_mask))

    def forward(self, x, pos, neg):
        h = self.encode(x)
        return (h * self.items(pos)).sum(-1), (h * self.items(neg)).sum(-1)


@torch.no_grad()
def rank_eval(net, seqs, shard, n_items, max_len, split, device, seed, ks=(5, 10, 20)):
    """Sampled metrics: target vs. 100 negatives not in the user's history."""
    net.eval()
    rng = np.random.default_rng(seed)
    sums = torch.zeros(2 * len(ks) + 1, device=device, dtype=torch.float64)
    for i in range(0, len(shard), 1024):
        users = shard[i:i + 1024]
        X = np.zeros((len(users), max_len), dtype=np.int64)
        C = np.zeros((len(users), 101), dtype=np.int64)
        for r, u in enumerate(users):
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-max_len:]
            X[r, max_len - len(hist):] = hist
            seen = set(s)
            negs = [c for c in rng.integers(1, n_items + 1, size=300) if c not in seen][:100]
            while len(negs) < 100:
                c = int(rng.integers(1, n_items + 1))
                if c not in seen:
                    negs.append(c)
            C[r, 0], C[r, 1:] = tgt, negs
        X, C = torch.from_numpy(X).to(device), torch.from_numpy(C).to(device)
        h = net.encode(X)[:, -1]
        sc = torch.einsum("bd,bcd->bc", h, net.items(C))
        rk = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        for j, k in enumerate(ks):
            hit = (rk < k).double()
            sums[2 * j] += hit.sum()
            sums[2 * j + 1] += (hit / torch.log2(rk + 2.0)).sum()
        sums[-1] += len(users)
    dist.all_reduce(sums)
    net.train()
    res = {}
    for j, k in enumerate(ks):
        res[f"HR@{k}"] = (sums[2 * j] / sums[-1]).item()
        res[f"NDCG@{k}"] = (sums[2 * j + 1] / sums[-1]).item()
    return res


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, n_items = load_yelp(args.reviews, args.since, args.core)
    LOG.info("yelp: %d users %d items", len(seqs), n_items)

    train_ds = YelpTrain(seqs, n_items, args.max_seq_len, args.seed)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)

    net = SASRec(n_items, args.max_seq_len, args.emb, args.n_blocks, args.n_heads, args.p_drop).to(device)
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    shard = list(range(rank, len(seqs), world))
    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)
    best, bad_epochs, log_rows = -1.0, 0, []
    for epoch in range(args.epochs):
        model.train()
        start = time.time()
        running = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            x, pos, neg = batch[:, 0], batch[:, 1], batch[:, 2]
            pos_logit, neg_logit = model(x, pos, neg)
            valid = pos > 0
            loss = -(F.logsigmoid(pos_logit[valid]) + F.logsigmoid(-neg_logit[valid])).mean()
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            running += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(running)

        res = rank_eval(net, seqs, shard, n_items, args.max_seq_len, "valid", device, seed=rank)
        row = {"epoch": epoch, "loss": (running[0] / running[1]).item(), "sec": time.time() - start, **res}
        log_rows.append(row)
        LOG.info(json.dumps(row))

        if res["NDCG@10"] > best:
            best, bad_epochs = res["NDCG@10"], 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.workdir, "best.pt"))
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= args.patience:
            LOG.info("early stop at epoch %d", epoch)
            break

    ckpt = torch.load(os.path.join(args.workdir, "best.pt"), map_location=device)
    net.load_state_dict(ckpt["model"])
    test = rank_eval(net, seqs, shard, n_items, args.max_seq_len, "test", device, seed=10_000 + rank)
    LOG.info("test (epoch %d): %s", ckpt["epoch"], json.dumps(test))
    if rank == 0:
        with open(os.path.join(args.workdir, "log.json"), "w") as f:
            json.dump({"epochs": log_rows, "test": test, "best_epoch": ckpt["epoch"]}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
