"""DCN-v2 for card-transaction fraud detection (IEEE-CIS style features).

Categorical columns are mapped with the vocabulary file produced by build_vocab.py,
numeric columns are quantile-clipped and standardised with precomputed statistics.

    torchrun --nproc_per_node=4 20_dcnv2_fraud.py --train data/fraud/train.parquet \
        --valid data/fraud/valid.parquet --meta data/fraud/meta.json
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FraudTable(Dataset):
    def __init__(self, path, meta):
        df = pd.read_parquet(path)
        cats = []
        for col in meta["cat_cols"]:
            vocab = meta["vocab"][col]
            cats.append(df[col].astype(str).map(vocab).fillna(0).astype(np.int64).values)
        self.cat = torch.from_numpy(np.stack(cats, axis=1))
        num = df[meta["num_cols"]].astype(np.float32)
        lo = np.array([meta["num_stats"][c]["q01"] for c in meta["num_cols"]], dtype=np.float32)
        hi = np.array([meta["num_stats"][c]["q99"] for c in meta["num_cols"]], dtype=np.float32)
        mu = np.array([meta["num_stats"][c]["mean"] for c in meta["num_cols"]], dtype=np.float32)
        sd = np.array([meta["num_stats"][c]["std"] for c in meta["num_cols"]], dtype=np.float32)
        missing = num.isna().values.astype(np.float32)
        num = (np.clip(num.fillna(pd.Series(mu, index=meta["num_cols"])).values, lo, hi) - mu) / sd
        self.num = torch.from_numpy(np.concatenate([num, missing], axis=1).astype(np.float32))
        self.y = torch.from_numpy(df["isFraud"].values.astype(np.float32))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.y[i]


class CrossLayerV2(nn.Module):
    def __init__(self, d, rank=64):
        super().__init__()
        self.U = nn.Linear(d, rank, bias=False)
        self.V = nn.Linear(rank, d)

    def forward(self, x0, x):
        return x0 * self.V(self.U(x)) + x


class DCNv2(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim=16, n_cross=3, deep=(512, 256, 128)):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c + 1, min(emb_dim, (c + 1) // 2 + 1)) for c in cardinalities)
        d = sum(e.embedding_dim for e in self.embs) + n_num
        self.cross = nn.ModuleList(CrossLayerV2(d) for _ in range(n_cross))
        layers, prev = [], d
        for h in deep:
            layers += [nn.Linear(prev, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.1)]
            prev = h
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(d + prev, 1)

    def forward(self, cat, num):
        x0 = torch.cat([e(cat[:, i]) for i, e in enumerate(self.embs)] + [num], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.out(torch.cat([x, self.deep(x0)], dim=1)).squeeze(-1)


@torch.no_grad()
def predict_all(model, loader, n_total, world, device):
    """Scores for the whole validation set, in dataset order, on every rank."""
    model.eval()
    scores, labels = [], []
    for cat, num, y in loader:
        logits = model(cat.to(device, non_blocking=True), num.to(device, non_blocking=True))
        scores.append(torch.sigmoid(logits).float().cpu())
        labels.append(y)
    scores, labels = torch.cat(scores), torch.cat(labels)
    g_scores = [torch.empty_like(scores) for _ in range(world)]
    g_labels = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(g_scores, scores)
    dist.all_gather(g_labels, labels)
    # DistributedSampler(shuffle=False) gives rank r the indices r, r+world, ...; undo and drop padding
    scores = torch.stack(g_scores, dim=1).flatten()[:n_total]
    labels = torch.stack(g_labels, dim=1).flatten()[:n_total]
    return scores.numpy(), labels.numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/dcnv2_fraud")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.meta) as f:
        meta = json.load(f)
    train_ds = FraudTable(args.train, meta)
    valid_ds = FraudTable(args.valid, meta)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=2 * args.batch_size, sampler=valid_sampler,
                              num_workers=4, pin_memory=True)

    cards = [len(meta["vocab"][c]) for c in meta["cat_cols"]]
    model = DCNv2(cards, train_ds.num.shape[1]).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr,
                                                total_steps=args.epochs * len(train_loader))
    pos_weight = torch.tensor(meta["neg_pos_ratio"] ** 0.5, device=device)

    os.makedirs(args.out, exist_ok=True)
    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for cat, num, y in train_loader:
            cat, num, y = cat.to(device, non_blocking=True), num.to(device, non_blocking=True), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(cat, num), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        scores, labels = predict_all(model, valid_loader, len(valid_ds), world, device)
        if rank == 0:
            auc = roc_auc_score(labels, scores)
            ap = average_precision_score(labels, scores)
            print(f"epoch {epoch:2d} loss {(run[0] / run[1]).item():.4f} val AUC {auc:.4f} "
                  f"AP {ap:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc, "ap": ap},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
