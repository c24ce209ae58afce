# SASRec on Amazon Books (2018 ratings-only dump), 5-core, leave-one-out.
#
#   torchrun --nproc_per_node=8 06_sasrec_amazon_books.py \
#       --ratings /data/amazon18/Books.csv --out /data/exp/sasrec_books
import argparse
import json
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratings", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--k_core", type=int, default=5)
    ap.add_argument("--maxlen", type=int, default=50)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--drop", type=float, default=0.3)
    ap.add_argument("--bs", type=int, default=256, help="per-GPU batch size")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--eval_every", type=int, default=2)
    ap.add_argument("--n_neg_eval", type=int, default=100)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def k_core(df, k):
    while True:
        u_cnt = df.groupby("user")["item"].transform("size")
        i_cnt = df.groupby("item")["user"].transform("size")
        keep = (u_cnt >= k) & (i_cnt >= k)
        if keep.all():
            return df
        df = df[keep]


def prepare(path, k):
    df = pd.read_csv(path, names=["item", "user", "rating", "ts"], dtype={"item": str, "user": str})
    df = df.drop_duplicates(["user", "item"], keep="first")
    df = k_core(df, k)
    items = list(set(df["item"]))
    item2id = {asin: i + 1 for i, asin in enumerate(items)}
    df = df.assign(iid=df["item"].map(item2id)).sort_values(["user", "ts"], kind="stable")
    user_seqs = df.groupby("user", sort=True)["iid"].apply(list)
    return user_seqs.tolist(), item2id


class NextItemDataset(Dataset):
    def __init__(self, seqs, n_items, maxlen):
        self.seqs = seqs
        self.n_items = n_items
        self.maxlen = maxlen

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i][:-2]
        inp, tgt = s[:-1][-self.maxlen:], s[1:][-self.maxlen:]
        seen = set(self.seqs[i])
        neg = np.random.randint(1, self.n_items + 1, size=len(tgt))
        for j in range(len(neg)):
            while neg[j] in seen:
                neg[j] = np.random.randint(1, self.n_items + 1)
        pad = self.maxlen - len(inp)
        z = [0] * pad
        return (torch.LongTensor(z + inp), torch.LongTensor(z + tgt), torch.LongTensor(z + neg.tolist()))


class CausalBlock(nn.Module):
    def __init__(self, dim, heads, drop):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=drop, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(drop), nn.Linear(dim, dim), nn.Dropout(drop))

    def forward(self, x, causal):
        q = self.ln1(x)
        x = q + self.attn(q, x, x, attn_mask=causal, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class SASRec(nn.Module):
    def __init__(self, n_items, maxlen, dim, blocks, heads, drop):
        super().__init__()
        self.item = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.pos = nn.Embedding(maxlen, dim)
        self.drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads, drop) for _ in range(blocks))
        self.ln = nn.LayerNorm(dim)
        self.register_buffer("causal", torch.triu(torch.ones(maxlen, maxlen, dtype=torch.bool), 1), persistent=False)

    def encode(self, seq):
        L = seq.size(1)
        x = self.item(seq) * math.sqrt(self.item.embedding_dim) + self.pos.weight[:L]
        x = self.drop(x)
        pad = (seq == 0).unsqueeze(-1)
        for blk in self.blocks:
            x = blk(x, self.causal[:L, :L]).masked_fill(pad, 0.0)
        return self.ln(x)

    def forward(self, seq, pos, neg):
        h = self.encode(seq)
        return (h * self.item(pos)).sum(-1), (h * self.item(neg)).sum(-1)


@torch.no_grad()
def evaluate(net, seqs, users, n_items, maxlen, n_neg, split, device, seed):
    net.eval()
    rng = np.random.default_rng(seed)
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for b in range(0, len(users), 1024):
        chunk = users[b:b + 1024]
        inp, cand = [], []
        for u in chunk:
            s = seqs[u]
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-maxlen:]
            inp.append([0] * (maxlen - len(hist)) + hist)
            seen = set(s)
            negs = []
            while len(negs) < n_neg:
                c = int(rng.integers(1, n_items + 1))
                if c not in seen:
                    negs.append(c)
            cand.append([tgt] + negs)
        inp = torch.tensor(inp, device=device)
        cand = torch.tensor(cand, device=device)
        h = net.encode(inp)[:, -1]
        sc = (net.item(cand) * h.unsqueeze(1)).sum(-1)
        r = (sc[:, 1:] > sc[:, :1]).sum(1)
        hit = r < 10
        acc[0] += hit.sum()
        acc[1] += (hit.double() / torch.log2(r.double() + 2)).sum()
        acc[2] += len(chunk)
    dist.all_reduce(acc)
    net.train()
    return {"HR@10": (acc[0] / acc[2]).item(), "NDCG@10": (acc[1] / acc[2]).item()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, item2id = prepare(args.ratings, args.k_core)
    n_items = len(item2id)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "item2id.json"), "w") as f:
            json.dump(item2id, f)
        print(f"users {len(seqs)} items {n_items} interactions {sum(map(len, seqs))}", flush=True)

    ds = NextItemDataset(seqs, n_items, args.maxlen)
    sampler = DistributedSampler(ds, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True)

    net = SASRec(n_items, args.maxlen, args.dim, args.blocks, args.heads, args.drop).to(dev)
    model = DDP(net, device_ids=[local_rank])
    # linear lr scaling from the single-GPU reference (bs 256)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world, betas=(0.9, 0.98))
    warm = 500
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    scaler = GradScaler()

    my_users = list(range(rank, len(seqs), world))
    best, history = 0.0, []
    for ep in range(1, args.epochs + 1):
        sampler.set_epoch(ep)
        t0 = time.time()
        tot = torch.zeros(2, device=dev)
        for seq, pos, neg in dl:
            seq, pos, neg = seq.to(dev), pos.to(dev), neg.to(dev)
            with autocast():
                pl, nl = model(seq, pos, neg)
            m = pos > 0
            loss = F.binary_cross_entropy_with_logits(pl[m].float(), torch.ones_like(pl[m], dtype=torch.float32)) + \
                F.binary_cross_entropy_with_logits(nl[m].float(), torch.zeros_like(nl[m], dtype=torch.float32))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"ep {ep} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if ep % args.eval_every == 0:
            val = evaluate(net, seqs, my_users, n_items, args.maxlen, args.n_neg_eval, "valid", dev, args.seed + rank)
            history.append({"epoch": ep, **val})
            if rank == 0:
                print(f"ep {ep} valid {val}", flush=True)
                if val["NDCG@10"] > best:
                    best = val["NDCG@10"]
                    torch.save({"model": net.state_dict(), "epoch": ep}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    state = torch.load(os.path.join(args.out, "best.pt"), map_location=dev)
    net.load_state_dict(state["model"])
    test = evaluate(net, seqs, my_users, n_items, args.maxlen, args.n_neg_eval, "test", dev, args.seed + 1000 + rank)
    if rank == 0:
        print(f"test {test}", flush=True)
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"valid": history, "test": test}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
