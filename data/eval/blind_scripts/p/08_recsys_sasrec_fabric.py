"""SASRec-style next-item recommendation trained with Lightning Fabric.

Eval: leave-last-out; for every eval user rank the full catalogue (minus history),
collect the ranks of *all* held-out items of that user (some users have several
held-out interactions on the last day), then Recall@K / NDCG@K over everything.

    fabric run --accelerator=cuda --devices=4 08_recsys_sasrec_fabric.py --data data/seq.parquet
"""
import argparse
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

PAD = 0


def pad_left(seq, n):
    seq = seq[-n:]
    return [PAD] * (n - len(seq)) + list(seq)


class TrainSeqs(Dataset):
    def __init__(self, seqs, max_len):
        self.seqs = [s for s in seqs if len(s) >= 2]
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        inp = pad_left(s[:-1], self.max_len)
        tgt = pad_left(s[1:], self.max_len)
        return torch.tensor(inp), torch.tensor(tgt)


class EvalUsers(Dataset):
    def __init__(self, histories, heldout, max_len):
        self.users = sorted(heldout)
        self.hist = histories
        self.heldout = heldout
        self.max_len = max_len

    def __len__(self):
        return len(self.users)

    def __getitem__(self, i):
        u = self.users[i]
        return torch.tensor(pad_left(self.hist[u], self.max_len)), u


class SASRec(nn.Module):
    def __init__(self, n_items, d=128, n_layers=2, n_heads=2, max_len=100, dropout=0.2):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, d, padding_idx=PAD)
        self.pos_emb = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("causal", torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), 1))

    def forward(self, seq):
        L = seq.size(1)
        pos = torch.arange(L, device=seq.device).unsqueeze(0)
        h = self.drop(self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb(pos))
        h = self.blocks(h, mask=self.causal[:L, :L], src_key_padding_mask=(seq == PAD))
        return self.norm(h)

    def scores(self, h_last):
        return h_last @ self.item_emb.weight.T


def load(path, max_len):
    df = pd.read_parquet(path).sort_values(["user_id", "ts"])
    item_ids = {v: i + 1 for i, v in enumerate(df["item_id"].unique())}
    df["item"] = df["item_id"].map(item_ids)
    df["day"] = pd.to_datetime(df["ts"], unit="s").dt.floor("D")
    last_day = df.groupby("user_id")["day"].transform("max")
    hist_df, held_df = df[df["day"] < last_day], df[df["day"] == last_day]
    hist = hist_df.groupby("user_id")["item"].apply(list).to_dict()
    held = {u: items for u, items in held_df.groupby("user_id")["item"].apply(list).items()
            if u in hist and len(hist[u]) >= 3}
    return hist, held, len(item_ids)


def evaluate(fabric, model, loader, ds, k=(10, 20)):
    model.eval()
    rank_chunks = []
    with torch.no_grad():
        for seq, users in loader:
            h = model(seq)[:, -1]
            s = model.scores(h)
            s[:, PAD] = -1e9
            for row, u in enumerate(users.tolist()):
                s[row, torch.tensor(ds.hist[u], device=s.device)] = -1e9
                tgt = torch.tensor(ds.heldout[u], device=s.device)
                tgt_scores = s[row, tgt]
                rank_chunks.append((s[row].unsqueeze(0) > tgt_scores.unsqueeze(1)).sum(1))
    local_ranks = torch.cat(rank_chunks)
    all_ranks = fabric.all_gather(local_ranks).flatten()
    out = {}
    for kk in k:
        hit = (all_ranks < kk).float()
        out[f"recall@{kk}"] = hit.mean().item()
        out[f"ndcg@{kk}"] = (hit / torch.log2(all_ranks.float() + 2)).mean().item()
    model.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/seq.parquet")
    ap.add_argument("--max-len", type=int, default=100)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt", default="ckpt/sasrec.ckpt")
    args = ap.parse_args()

    fabric = Fabric(precision="bf16-mixed")
    fabric.launch()
    fabric.seed_everything(11)

    hist, held, n_items = load(args.data, args.max_len)
    train_seqs = [hist[u] for u in sorted(hist)]
    train_ds = TrainSeqs(train_seqs, args.max_len)
    eval_ds = EvalUsers(hist, held, args.max_len)
    fabric.print(f"items={n_items} train_users={len(train_ds)} eval_users={len(eval_ds)}")

    model = SASRec(n_items, max_len=args.max_len)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    model, opt = fabric.setup(model, opt)
    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=4, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=128, shuffle=False, num_workers=2)
    train_dl, eval_dl = fabric.setup_dataloaders(train_dl, eval_dl)

    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        tot, n = 0.0, 0
        for seq, tgt in train_dl:
            h = model(seq)
            logits = model.scores(h.reshape(-1, h.size(-1)))
            loss = F.cross_entropy(logits.float(), tgt.reshape(-1), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            opt.step()
            tot += loss.item(); n += 1
        fabric.print(f"epoch {epoch} train_loss {tot / max(n, 1):.4f}")
        if (epoch + 1) % 5 == 0:
            metrics = evaluate(fabric, model, eval_dl, eval_ds)
            fabric.print(f"epoch {epoch} {metrics}")
            if metrics["ndcg@10"] > best:
                best = metrics["ndcg@10"]
                fabric.save(args.ckpt, {"model": model, "opt": opt, "epoch": epoch, "best": best})


if __name__ == "__main__":
    main()
