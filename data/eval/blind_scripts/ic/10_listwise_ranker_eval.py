"""Listwise neural LTR model over precomputed ranking features.

Per query we get up to 200 candidate products from the retrieval stage with
~140 dense features (BM25 fields, two-tower cosine, CTR/CVR priors, price and
rating stats, freshness ...) and a graded label derived from clicks/orders.
Model: per-item MLP with a self-attention block over the list (DASALC-like),
trained with an ApproxNDCG loss.

    torchrun --nproc_per_node=4 10_listwise_ranker_eval.py --train /data/ltr/v12/train.npz \
        --valid /data/ltr/v12/valid.npz --out /data/ltr/models/dasalc_v12
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--list_size", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch_queries", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--alpha", type=float, default=10.0, help="ApproxNDCG temperature")
    return ap.parse_args()


class QueryLists(Dataset):
    """npz with X [n_items, F] float32, y [n_items] int8, qptr [n_queries + 1] int64 (CSR offsets)."""

    def __init__(self, path, list_size, stats=None):
        z = np.load(path)
        self.X, self.y, self.qptr = z["X"], z["y"], z["qptr"]
        self.list_size = list_size
        if stats is None:
            # log1p for heavy-tailed count features, then z-score
            Xl = np.sign(self.X) * np.log1p(np.abs(self.X))
            stats = (Xl.mean(0), Xl.std(0) + 1e-6)
        self.stats = stats

    def __len__(self):
        return len(self.qptr) - 1

    def __getitem__(self, q):
        s, e = self.qptr[q], min(self.qptr[q + 1], self.qptr[q] + self.list_size)
        x = np.sign(self.X[s:e]) * np.log1p(np.abs(self.X[s:e]))
        x = (x - self.stats[0]) / self.stats[1]
        n = e - s
        X = np.zeros((self.list_size, x.shape[1]), dtype=np.float32)
        y = np.full(self.list_size, -1.0, dtype=np.float32)  # -1 marks padding
        X[:n], y[:n] = x, self.y[s:e]
        return torch.from_numpy(X), torch.from_numpy(y)


class ListRanker(nn.Module):
    def __init__(self, n_feat, hidden, heads):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(n_feat, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU())
        self.attn = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=2 * hidden, dropout=0.1,
                                               batch_first=True, norm_first=True)
        self.out = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, pad_mask):
        h = self.inp(x)
        ctx = self.attn(h, src_key_padding_mask=pad_mask)
        return self.out(torch.cat([h, ctx], dim=-1)).squeeze(-1)


def approx_ndcg_loss(scores, y, alpha):
    valid = y >= 0
    scores = scores.masked_fill(~valid, -1e4)
    gains = torch.where(valid, 2.0 ** y - 1, torch.zeros_like(y))
    diff = scores.unsqueeze(-1) - scores.unsqueeze(-2)            # s_i - s_j
    approx_rank = 1.0 + (torch.sigmoid(-alpha * diff) * valid.unsqueeze(-2)).sum(-1) - 0.5
    dcg = (gains / torch.log2(1.0 + approx_rank)).sum(-1)
    ideal = gains.sort(dim=-1, descending=True).values
    idcg = (ideal / torch.log2(torch.arange(2, y.size(1) + 2, device=y.device).float())).sum(-1)
    keep = idcg > 0
    return -(dcg[keep] / idcg[keep]).mean()


def ndcg_at(scores, y, k):
    """scores, y: [B, L] tensors with y=-1 for padding. Returns per-query NDCG@k (queries with gain only)."""
    scores = scores.masked_fill(y < 0, -1e9)
    order = scores.argsort(dim=-1, descending=True)
    g = (2.0 ** y.clamp(min=0) - 1)
    disc = 1.0 / torch.log2(torch.arange(2, k + 2, device=y.device).float())
    dcg = (g.gather(-1, order)[:, :k] * disc).sum(-1)
    idcg = (g.sort(dim=-1, descending=True).values[:, :k] * disc).sum(-1)
    keep = idcg > 0
    return dcg[keep] / idcg[keep]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    n5, n10 = [], []
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        s = model(X, y < 0)
        n5.append(ndcg_at(s, y, 5))
        n10.append(ndcg_at(s, y, 10))
    model.train()
    return torch.cat(n5).mean().item(), torch.cat(n10).mean().item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    train = QueryLists(args.train, args.list_size)
    valid = QueryLists(args.valid, args.list_size, stats=train.stats)  # normalise with train stats
    n_feat = train.X.shape[1]

    train_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid, shuffle=False, drop_last=False)
    train_dl = DataLoader(train, batch_size=args.batch_queries, sampler=train_sampler, num_workers=4,
                          drop_last=True, pin_memory=True)
    valid_dl = DataLoader(valid, batch_size=256, sampler=valid_sampler, num_workers=2)

    model = DDP(ListRanker(n_feat, args.hidden, args.heads).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "feature_stats.npz"), mean=train.stats[0], std=train.stats[1])
    best, history = -1.0, []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = 0.0
        for X, y in train_dl:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = approx_ndcg_loss(model(X, y < 0), y, args.alpha)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            running += loss.item()

        ndcg5, ndcg10 = evaluate(model.module, valid_dl, device)
        if rank == 0:
            rec = {"epoch": epoch, "train_loss": running / len(train_dl), "ndcg@5": ndcg5, "ndcg@10": ndcg10,
                   "sec": round(time.time() - t0, 1)}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            if ndcg10 > best:
                best = ndcg10
                torch.save({"model": model.module.state_dict(), "n_feat": n_feat, "args": vars(args), "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    if rank == 0:
        print(f"best valid NDCG@10 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
