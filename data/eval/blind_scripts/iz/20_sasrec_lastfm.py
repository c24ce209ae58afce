"""SASRec next-artist prediction on Last.fm-1K listening histories.

Consecutive plays of the same artist are collapsed; users keep their last 2000 events.
Leave-one-out with 100 sampled negatives, HR@10 / NDCG@10 / MRR.

    torchrun --nproc_per_node=4 20_sasrec_lastfm.py \
        --tsv data/lastfm-dataset-1K/userid-timestamp-artid-artname-traid-traname.tsv
"""
import argparse
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
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tsv", required=True)
    p.add_argument("--logdir", default="runs/sasrec_lastfm")
    p.add_argument("--max_events", type=int, default=2000)
    p.add_argument("--min_artist_users", type=int, default=5)
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--global_batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=31)
    return p.parse_args()


def load_lastfm(path, max_events, min_users):
    df = pd.read_csv(path, sep="\t", header=None, usecols=[0, 1, 2],
                     names=["user", "ts", "artist"], on_bad_lines="skip", quoting=3)
    df = df.dropna(subset=["artist"])
    df["ts"] = pd.to_datetime(df["ts"])
    users_per_artist = df.groupby("artist")["user"].nunique()
    df = df[df["artist"].isin(users_per_artist.index[users_per_artist >= min_users])]
    df = df.sort_values(["user", "ts"], kind="mergesort")
    # collapse repeated plays of the same artist
    df = df[df["artist"].ne(df.groupby("user")["artist"].shift())]
    df["aid"] = pd.factorize(df["artist"], sort=True)[0] + 1
    seqs = [s[-max_events:] for s in df.groupby("user", sort=True)["aid"].agg(list)]
    seqs = [s for s in seqs if len(s) >= 5]
    return seqs, int(df["aid"].max())


class TrainWindows(Dataset):
    """Long histories are cut into max_len windows, each one a training sequence."""

    def __init__(self, seqs, n_items, max_len):
        self.n_items = n_items
        self.max_len = max_len
        self.windows, self.owner = [], []
        for u, s in enumerate(seqs):
            s = s[:-2]
            for end in range(len(s), 1, -max_len):
                self.windows.append(s[max(0, end - max_len - 1):end])
                self.owner.append(u)
        self.user_items = [set(s) for s in seqs]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        w = self.windows[i]
        seen = self.user_items[self.owner[i]]
        x, y = w[:-1], w[1:]
        n = []
        for _ in y:
            c = random.randint(1, self.n_items)
            while c in seen:
                c = random.randint(1, self.n_items)
            n.append(c)
        z = [0] * (self.max_len - len(x))
        return torch.tensor(z + x), torch.tensor(z + y), torch.tensor(z + n)


class LeaveOneOutEval(Dataset):
    def __init__(self, seqs, n_items, max_len, split, seed):
        rng = np.random.default_rng(seed)
        self.x, self.c = [], []
        for s in seqs:
            hist, tgt = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            hist = hist[-max_len:]
            seen = set(s)
            negs = []
            while len(negs) < 100:
                k = int(rng.integers(1, n_items + 1))
                if k not in seen:
                    negs.append(k)
            self.x.append([0] * (max_len - len(hist)) + hist)
            self.c.append([tgt] + negs)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.tensor(self.x[i]), torch.tensor(self.c[i])


class SASRec(nn.Module):
    def __init__(self, n_items, max_len, hidden, blocks, heads, dropout):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, hidden)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout, batch_first=True, norm_first=True),
            blocks, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(hidden)

    def encode(self, x):
        L = x.size(1)
        h = self.item_emb(x) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb.weight[:L]
        h = self.drop(h) * (x != 0).unsqueeze(-1)
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=x.device), 1)
        return self.ln(self.encoder(h, mask=mask))

    def forward(self, x, pos, neg):
        h = self.encode(x)
        return (h * self.item_emb(pos)).sum(-1), (h * self.item_emb(neg)).sum(-1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hits, ndcgs, rrs = [], [], []
    for x, c in loader:
        x, c = x.to(device), c.to(device)
        h = net.encode(x)[:, -1]
        sc = torch.einsum("bd,bkd->bk", h, net.item_emb(c))
        r = (sc[:, 1:] > sc[:, :1]).sum(1).float()
        hit = (r < 10).float()
        hits.append(hit)
        ndcgs.append(hit / torch.log2(r + 2))
        rrs.append(1.0 / (r + 1))
    net.train()
    return {"HR@10": torch.cat(hits).mean().item(),
            "NDCG@10": torch.cat(ndcgs).mean().item(),
            "MRR": torch.cat(rrs).mean().item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    seqs, n_items = load_lastfm(args.tsv, args.max_events, args.min_artist_users)
    train_ds = TrainWindows(seqs, n_items, args.max_len)
    valid_ds = LeaveOneOutEval(seqs, n_items, args.max_len, "valid", seed=args.seed)
    test_ds = LeaveOneOutEval(seqs, n_items, args.max_len, "test", seed=args.seed + 1)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=256, sampler=DistributedSampler(valid_ds, shuffle=False))
    test_dl = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False))

    net = SASRec(n_items, args.max_len, args.hidden, args.blocks, args.heads, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    if rank == 0:
        print(f"users {len(seqs)} artists {n_items} train windows {len(train_ds)}", flush=True)
    best = -1.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, p, n in train_dl:
            x, p, n = x.to(device), p.to(device), n.to(device)
            pl, nl = model(x, p, n)
            m = p > 0
            loss = F.binary_cross_entropy_with_logits(pl[m], torch.ones_like(pl[m])) + \
                F.binary_cross_entropy_with_logits(nl[m], torch.zeros_like(nl[m]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            writer.add_scalar("loss/train", (agg[0] / agg[1]).item(), epoch)

        if epoch % args.eval_every == 0:
            res = evaluate(net, valid_dl, device)
            if rank == 0:
                for k, v in res.items():
                    writer.add_scalar(f"valid/{k}", v, epoch)
                print(f"epoch {epoch} ({time.time() - t0:.0f}s) valid {res}", flush=True)
                if res["NDCG@10"] > best:
                    best = res["NDCG@10"]
                    torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.logdir, "best.pt"))
            dist.barrier()

    ckpt = torch.load(os.path.join(args.logdir, "best.pt"), map_location=device)
    net.load_state_dict(ckpt["model"])
    res = evaluate(net, test_dl, device)
    if rank == 0:
        print(f"test (epoch {ckpt['epoch']}) {res}", flush=True)
        writer.add_hparams({"lr": args.lr, "hidden": args.hidden, "max_len": args.max_len},
                           {f"hparam/test_{k}": v for k, v in res.items()})
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
