"""News recommendation (MIND-format impressions) with a two-tower model.

News tower: news id + category + bag of title tokens.
User tower: attention-free mean over the clicked-history news vectors.
Training: one clicked news vs K non-clicked news from the same impression
(list-wise softmax, as in NRMS). Eval: mean per-impression AUC and MRR.

    torchrun --nproc_per_node=4 18_two_tower_news_rec.py --mind_dir /data/MIND/large --epochs 5
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_HIST = 50
MAX_TITLE = 24


def pad(seq, n, left=True):
    seq = list(seq)[-n:] if left else list(seq)[:n]
    return ([0] * (n - len(seq)) + seq) if left else (seq + [0] * (n - len(seq)))


class NewsTable:
    """news_idx (0 = padding) -> category id and title token ids."""

    def __init__(self, path):
        news = pd.read_parquet(path, columns=["news_idx", "category_id", "title_tokens"]).sort_values("news_idx")
        n = int(news["news_idx"].max()) + 1
        self.category = np.zeros(n, np.int64)
        self.title = np.zeros((n, MAX_TITLE), np.int64)
        self.category[news["news_idx"].to_numpy()] = news["category_id"].to_numpy()
        self.title[news["news_idx"].to_numpy()] = np.stack([pad(t, MAX_TITLE, left=False) for t in news["title_tokens"]])
        self.size = n


class TrainImpressions(Dataset):
    def __init__(self, path, k_neg):
        df = pd.read_parquet(path, columns=["history", "clicked", "non_clicked"])
        df = df[df["non_clicked"].map(len) > 0]
        self.hist = np.stack([pad(h, MAX_HIST) for h in df["history"]])
        self.pos = df["clicked"].to_numpy(np.int64)
        self.neg = df["non_clicked"].tolist()
        self.k = k_neg

    def __len__(self):
        return len(self.pos)

    def __getitem__(self, i):
        neg = np.asarray(self.neg[i], dtype=np.int64)
        pick = torch.randint(len(neg), (self.k,)).numpy()  # with replacement if the impression is short
        cands = np.concatenate([[self.pos[i]], neg[pick]])
        return self.hist[i], cands


class NewsRecModel(nn.Module):
    def __init__(self, n_news, n_cat, vocab, dim=128):
        super().__init__()
        self.news_emb = nn.Embedding(n_news, dim, padding_idx=0)
        self.cat_emb = nn.Embedding(n_cat, 32)
        self.title = nn.EmbeddingBag(vocab, dim, mode="mean", padding_idx=0)
        self.news_proj = nn.Sequential(nn.Linear(2 * dim + 32, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.user_proj = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))

    def encode_news(self, idx, cat, title):
        shape = idx.shape
        idx, cat, title = idx.reshape(-1), cat.reshape(-1), title.reshape(-1, title.size(-1))
        v = self.news_proj(torch.cat([self.news_emb(idx), self.cat_emb(cat), self.title(title)], -1))
        return v.view(*shape, -1)

    def encode_user(self, hist_vecs, hist_idx):
        mask = (hist_idx > 0).unsqueeze(-1).float()
        return self.user_proj((hist_vecs * mask).sum(1) / mask.sum(1).clamp(min=1.0))

    def forward(self, hist, h_cat, h_title, cands, c_cat, c_title):
        u = self.encode_user(self.encode_news(hist, h_cat, h_title), hist)
        c = self.encode_news(cands, c_cat, c_title)
        return torch.einsum("bd,bkd->bk", u, c)


def lookup(table, idx, device):
    cat = torch.from_numpy(table.category[idx.numpy()]).to(device, non_blocking=True)
    title = torch.from_numpy(table.title[idx.numpy()]).to(device, non_blocking=True)
    return idx.to(device, non_blocking=True), cat, title


@torch.no_grad()
def evaluate(net, dev_df, table, device, rank, world):
    net.eval()
    part = dev_df.iloc[rank::world]
    sums = torch.zeros(3, device=device, dtype=torch.float64)  # auc sum, mrr sum, impressions
    for hist, cands, labels in zip(part["history"], part["candidates"], part["labels"]):
        labels = np.asarray(labels)
        if labels.min() == labels.max():
            continue
        h = torch.tensor([pad(hist, MAX_HIST)])
        c = torch.tensor([list(cands)])
        scores = net(*lookup(table, h, device), *lookup(table, c, device))[0].cpu().numpy()
        sums[0] += roc_auc_score(labels, scores)
        order = np.argsort(-scores)
        ranks = np.nonzero(labels[order])[0] + 1
        sums[1] += float(np.mean(1.0 / ranks))
        sums[2] += 1
    dist.all_reduce(sums)
    net.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mind_dir", required=True)
    ap.add_argument("--out", default="/data/MIND/runs/tt")
    ap.add_argument("--vocab", type=int, default=70_000)
    ap.add_argument("--n_cat", type=int, default=300)
    ap.add_argument("--k_neg", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    table = NewsTable(os.path.join(args.mind_dir, "news.parquet"))
    train_ds = TrainImpressions(os.path.join(args.mind_dir, "train_impressions.parquet"), args.k_neg)
    dev_df = pd.read_parquet(os.path.join(args.mind_dir, "dev_impressions.parquet"),
                             columns=["history", "candidates", "labels"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    torch.manual_seed(42)
    model = NewsRecModel(table.size, args.n_cat, args.vocab, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train impressions, {len(dev_df)} dev impressions, {table.size} news", flush=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for step, (hist, cands) in enumerate(loader, 1):
            scores = model(*lookup(table, hist, device), *lookup(table, cands, device))
            loss = F.cross_entropy(scores, torch.zeros(scores.size(0), dtype=torch.long, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 500 == 0 and rank == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f} (rank0) "
                      f"{(time.time() - t0) / step * 1000:.0f} ms/step", flush=True)
        dist.all_reduce(tot)

        auc, mrr = evaluate(model.module, dev_df, table, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(tot[0] / tot[1]).item():.4f}  dev AUC {auc:.4f}  MRR {mrr:.4f}",
                  flush=True)
            ckpt = {"model": model.module.state_dict(), "epoch": epoch, "auc": auc, "mrr": mrr}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if auc > best_auc:
                best_auc = auc
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
