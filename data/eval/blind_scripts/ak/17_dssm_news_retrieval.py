#!/usr/bin/env python
"""DSSM-style news retrieval on MIND (user history -> candidate news), DDP.

News titles are tokenised with a hashed word vocabulary (no external tokenizer);
the user encoder attends over the clicked-news vectors. Training: one clicked
impression vs. K non-clicked impressions from the same impression log (listwise
softmax, "npratio" as in the MIND baselines). Metrics: AUC / MRR / nDCG@5,10
computed per impression and averaged over all ranks.

    torchrun --nproc_per_node=4 17_dssm_news_retrieval.py --mind data/MINDlarge \
        --project mind-retrieval --run-name dssm-h256
"""
import argparse
import os
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TITLE_LEN, HIST_LEN = 24, 50


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mind", required=True)
    p.add_argument("--vocab-buckets", type=int, default=300_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--npratio", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--project", default="mind-retrieval")
    p.add_argument("--run-name", default=None)
    p.add_argument("--ckpt", default="ckpt/dssm_mind.pt")
    return p.parse_args()


def tokenize(title, buckets):
    ids = [zlib.crc32(w.lower().encode()) % (buckets - 1) + 1 for w in title.split()[:TITLE_LEN]]
    return ids + [0] * (TITLE_LEN - len(ids))


def load_news(path, buckets):
    nid2idx, titles = {"<pad>": 0}, [[0] * TITLE_LEN]
    with open(path, encoding="utf-8") as f:
        for line in f:
            nid, _, _, title = line.rstrip("\n").split("\t")[:4]
            if nid not in nid2idx:
                nid2idx[nid] = len(titles)
                titles.append(tokenize(title, buckets))
    return nid2idx, torch.tensor(titles, dtype=torch.long)


def load_behaviors(path, nid2idx):
    rows = []
    with open(path) as f:
        for line in f:
            _, _, _, hist, imps = line.rstrip("\n").split("\t")
            h = [nid2idx.get(n, 0) for n in hist.split()][-HIST_LEN:]
            h = [0] * (HIST_LEN - len(h)) + h
            pos = [nid2idx.get(i[:-2], 0) for i in imps.split() if i.endswith("-1")]
            neg = [nid2idx.get(i[:-2], 0) for i in imps.split() if i.endswith("-0")]
            rows.append((h, pos, neg))
    return rows


class TrainSamples(Dataset):
    def __init__(self, rows, npratio):
        self.items = [(h, p, neg) for h, ps, neg in rows for p in ps if neg]
        self.npratio = npratio

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        h, p, neg = self.items[i]
        idx = np.random.randint(len(neg), size=self.npratio)
        cands = [p] + [neg[j] for j in idx]
        return torch.tensor(h), torch.tensor(cands)


class NewsEncoder(nn.Module):
    def __init__(self, buckets, dim):
        super().__init__()
        self.emb = nn.Embedding(buckets, 300, padding_idx=0)
        self.conv = nn.Conv1d(300, dim, 3, padding=1)
        self.att = nn.Sequential(nn.Linear(dim, 128), nn.Tanh(), nn.Linear(128, 1))

    def forward(self, tokens):  # (..., TITLE_LEN)
        shape = tokens.shape[:-1]
        t = tokens.reshape(-1, TITLE_LEN)
        h = F.relu(self.conv(F.dropout(self.emb(t), 0.2, self.training).transpose(1, 2))).transpose(1, 2)
        a = self.att(h).squeeze(-1).masked_fill(t == 0, -1e4).softmax(-1)
        return (a.unsqueeze(-1) * h).sum(1).reshape(*shape, -1)


class DSSM(nn.Module):
    def __init__(self, buckets, dim):
        super().__init__()
        self.news = NewsEncoder(buckets, dim)
        self.user_att = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.user_pool = nn.Sequential(nn.Linear(dim, 128), nn.Tanh(), nn.Linear(128, 1))

    def user(self, hist, titles):
        hv = self.news(titles[hist])
        hv, _ = self.user_att(hv, hv, hv, key_padding_mask=(hist == 0))
        w = self.user_pool(hv).squeeze(-1).masked_fill(hist == 0, -1e4).softmax(-1)
        return (w.unsqueeze(-1) * hv).sum(1)

    def forward(self, hist, cands, titles):
        # titles: (num_news, TITLE_LEN) token table of the split being scored
        return torch.einsum("bd,bkd->bk", self.user(hist, titles), self.news(titles[cands]))


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


def ndcg(y, s, k):
    order = np.argsort(-s)[:k]
    gains = y[order] / np.log2(np.arange(2, len(order) + 2))
    ideal = np.sort(y)[::-1][:k] / np.log2(np.arange(2, min(k, len(y)) + 2))
    return gains.sum() / ideal.sum()


@torch.no_grad()
def evaluate(model, rows, titles, device, rank, world):
    net = model.module
    net.eval()
    sums = np.zeros(5)
    for h, pos, neg in rows[rank::world]:
        if not pos or not neg:
            continue
        cands = torch.tensor([pos + neg], device=device)
        s = net(torch.tensor([h], device=device), cands, titles)[0].float().cpu().numpy()
        y = np.array([1] * len(pos) + [0] * len(neg))
        order = np.argsort(-s)
        mrr = (y[order] / np.arange(1, len(y) + 1)).sum() / y.sum()
        sums += [roc_auc_score(y, s), mrr, ndcg(y, s, 5), ndcg(y, s, 10), 1]
    t = torch.tensor(sums, device=device)
    dist.all_reduce(t)
    net.train()
    t = t.cpu().numpy()
    return dict(auc=t[0] / t[4], mrr=t[1] / t[4], ndcg5=t[2] / t[4], ndcg10=t[3] / t[4])


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    nid2idx, titles = load_news(os.path.join(args.mind, "train", "news.tsv"), args.vocab_buckets)
    dev_nid2idx, dev_titles = load_news(os.path.join(args.mind, "dev", "news.tsv"), args.vocab_buckets)
    train_rows = load_behaviors(os.path.join(args.mind, "train", "behaviors.tsv"), nid2idx)
    dev_rows = load_behaviors(os.path.join(args.mind, "dev", "behaviors.tsv"), dev_nid2idx)

    train_ds = TrainSamples(train_rows, args.npratio)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True,
                        worker_init_fn=seed_worker)

    torch.manual_seed(0)
    model = DDP(DSSM(args.vocab_buckets, args.dim).to(device), device_ids=[local_rank])
    titles, dev_titles = titles.to(device), dev_titles.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for hist, cands in loader:
            hist, cands = hist.to(device, non_blocking=True), cands.to(device, non_blocking=True)
            scores = model(hist, cands, titles)
            loss = F.cross_entropy(scores, torch.zeros(scores.size(0), dtype=torch.long, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                wandb.log({"train/loss": loss.item(), "epoch": epoch,
                           "train/samples_per_s": 100 * args.batch_size * world / (time.time() - t0)},
                          step=step)
                t0 = time.time()

        # dev news have their own index space, hence their own title table
        metrics = evaluate(model, dev_rows, dev_titles, device, rank, world)
        wandb.log({f"dev/{k}": v for k, v in metrics.items()}, step=step)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.ckpt)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
