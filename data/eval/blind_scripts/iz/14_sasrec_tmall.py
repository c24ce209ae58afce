"""SASRec on Tmall (IJCAI-15 repeat buyers log), purchase + add-to-favourite events.

    torchrun --nproc_per_node=8 14_sasrec_tmall.py --log data/tmall/user_log_format1.csv --exp exp/tmall_sasrec
"""
import argparse
import json
import math
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


def build_parser():
    parser = argparse.ArgumentParser("sasrec-tmall")
    parser.add_argument("--log", type=str, required=True)
    parser.add_argument("--exp", type=str, default="exp/tmall_sasrec")
    parser.add_argument("--actions", type=str, default="2,3", help="0 click, 1 cart, 2 purchase, 3 favourite")
    parser.add_argument("--min_len", type=int, default=5)
    parser.add_argument("--maxlen", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--batch_size", type=int, default=256, help="per GPU")
    parser.add_argument("--base_lr", type=float, default=1e-3, help="for 256 sequences per step")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--eval_freq", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def load_tmall(path, actions, min_len):
    keep = [int(a) for a in actions.split(",")]
    df = pd.read_csv(path, usecols=["user_id", "item_id", "time_stamp", "action_type"])
    df = df[df["action_type"].isin(keep)].drop_duplicates(["user_id", "item_id", "time_stamp"])
    for _ in range(5):
        df = df[df.groupby("item_id")["user_id"].transform("size") >= min_len]
        df = df[df.groupby("user_id")["item_id"].transform("size") >= min_len]
    df["iid"] = pd.factorize(df["item_id"], sort=True)[0] + 1
    df = df.sort_values(["user_id", "time_stamp"], kind="mergesort")
    seqs = df.groupby("user_id", sort=True)["iid"].agg(list).tolist()
    return seqs, int(df["iid"].max())


class TrainSet(Dataset):
    def __init__(self, seqs, n_items, maxlen):
        self.seqs = [s[:-2] for s in seqs]
        self.n_items = n_items
        self.maxlen = maxlen

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        seen = set(s)
        x, y = s[:-1][-self.maxlen:], s[1:][-self.maxlen:]
        n = []
        for _ in y:
            c = random.randint(1, self.n_items)
            while c in seen:
                c = random.randint(1, self.n_items)
            n.append(c)
        z = [0] * (self.maxlen - len(x))
        return torch.tensor(z + x), torch.tensor(z + y), torch.tensor(z + n)


class Block(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.n1 = nn.LayerNorm(d, eps=1e-8)
        self.mha = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.n2 = nn.LayerNorm(d, eps=1e-8)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(p), nn.Linear(d, d), nn.Dropout(p))

    def forward(self, x, attn_mask, keep):
        q = self.n1(x)
        x = q + self.mha(q, x, x, attn_mask=attn_mask, need_weights=False)[0]
        x = x + self.ffn(self.n2(x))
        return x * keep


class SASRec(nn.Module):
    def __init__(self, n_items, maxlen, d, blocks, heads, p):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList([Block(d, heads, p) for _ in range(blocks)])
        self.ln = nn.LayerNorm(d, eps=1e-8)

    def encode(self, x):
        L = x.size(1)
        keep = (x > 0).unsqueeze(-1).to(self.item_emb.weight.dtype)
        h = self.drop(self.item_emb(x) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb.weight[:L]) * keep
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=1)
        for blk in self.blocks:
            h = blk(h, mask, keep)
        return self.ln(h)

    def forward(self, x, pos, neg):
        h = self.encode(x)
        return (h * self.item_emb(pos)).sum(-1), (h * self.item_emb(neg)).sum(-1)


@torch.no_grad()
def evaluate(net, seqs, users, n_items, maxlen, split, device, seed):
    net.eval()
    g = np.random.default_rng(seed)
    s_hr = s_ndcg = s_mrr = 0.0
    tot = 0
    for b in range(0, len(users), 1024):
        part = users[b:b + 1024]
        X = np.zeros((len(part), maxlen), dtype=np.int64)
        C = np.zeros((len(part), 101), dtype=np.int64)
        for r, u in enumerate(part):
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-maxlen:]
            X[r, maxlen - len(hist):] = hist
            seen = set(s)
            C[r, 0] = tgt
            j = 1
            while j < 101:
                c = int(g.integers(1, n_items + 1))
                if c not in seen:
                    C[r, j] = c
                    j += 1
        X = torch.from_numpy(X).to(device)
        C = torch.from_numpy(C).to(device)
        h = net.encode(X)[:, -1]
        sc = (net.item_emb(C) * h[:, None, :]).sum(-1)
        rk = (sc[:, 1:] > sc[:, :1]).sum(1).double()
        hit = rk < 10
        s_hr += hit.sum().item()
        s_ndcg += (hit.double() / torch.log2(rk + 2)).sum().item()
        s_mrr += (1.0 / (rk + 1)).sum().item()
        tot += len(part)
    t = torch.tensor([s_hr, s_ndcg, s_mrr, tot], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    net.train()
    return {"HR@10": (t[0] / t[3]).item(), "NDCG@10": (t[1] / t[3]).item(), "MRR": (t[2] / t[3]).item()}


def main():
    args = build_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, n_items = load_tmall(args.log, args.actions, args.min_len)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        print(f"[data] users={len(seqs)} items={n_items} avg_len={np.mean([len(s) for s in seqs]):.1f}", flush=True)

    ds = TrainSet(seqs, n_items, args.maxlen)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    net = SASRec(n_items, args.maxlen, args.hidden, args.blocks, args.heads, args.dropout).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    steps_total = len(dl) * args.epochs
    warmup = max(1, int(0.05 * steps_total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps_total))))

    users = list(range(rank, len(seqs), world))
    best, summary = -1.0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for x, p, n in dl:
            x, p, n = x.to(device, non_blocking=True), p.to(device, non_blocking=True), n.to(device, non_blocking=True)
            pl, nl = model(x, p, n)
            m = p > 0
            loss = F.softplus(-pl[m]).mean() + F.softplus(nl[m]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"[train] epoch {epoch} loss {(meter[0] / meter[1]).item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_freq == 0:
            res = evaluate(net, seqs, users, n_items, args.maxlen, "valid", device, seed=args.seed * 100 + rank)
            summary.append({"epoch": epoch, **res})
            if rank == 0:
                print(f"[valid] epoch {epoch} {res}", flush=True)
                if res["NDCG@10"] > best:
                    best = res["NDCG@10"]
                    torch.save({"state_dict": net.state_dict(), "epoch": epoch, "n_items": n_items},
                               os.path.join(args.exp, "best.pth"))
            dist.barrier()

    state = torch.load(os.path.join(args.exp, "best.pth"), map_location=device)
    net.load_state_dict(state["state_dict"])
    res = evaluate(net, seqs, users, n_items, args.maxlen, "test", device, seed=args.seed * 1000 + rank)
    if rank == 0:
        print(f"[test] {res}", flush=True)
        with open(os.path.join(args.exp, "summary.json"), "w") as f:
            json.dump({"valid": summary, "test": res}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
