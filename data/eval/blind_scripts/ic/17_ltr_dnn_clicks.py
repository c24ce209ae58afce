"""Deep click model for search ranking (pointwise, position-debiased).

Inputs per (query, product, impression): sparse ids (query cluster, product,
brand, leaf category, seller) + dense ranking features.  A shallow position
tower is added to the logit during training only (PAL-style), so the main tower
learns position-free relevance.  Eval: AUC over impressions and NDCG@10 per
query on the held-out query set.

    torchrun --nproc_per_node=8 17_ltr_dnn_clicks.py --train /data/ctr/train --valid /data/ctr/valid
"""
import argparse
import glob
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SPARSE = {"query_cluster": 200_000, "product_id": 5_000_000, "brand": 300_000, "category": 20_000, "seller": 150_000}
N_DENSE = 48
MAX_POS = 50


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", default="/data/ctr/ckpt/pal_dnn")
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--batch_size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--emb_dim", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class Impressions(Dataset):
    def __init__(self, root):
        tables = [pq.read_table(f) for f in sorted(glob.glob(os.path.join(root, "*.parquet")))]
        cols = {k: np.concatenate([t[k].to_numpy() for t in tables]) for k in tables[0].column_names if k != "dense"}
        dense = np.concatenate([np.stack(t["dense"].to_numpy(zero_copy_only=False)) for t in tables])
        self.sparse = np.stack([cols[k] % n for k, n in SPARSE.items()], axis=1).astype(np.int64)
        self.dense = np.log1p(np.clip(dense, 0, None)).astype(np.float32)
        self.pos = np.minimum(cols["position"], MAX_POS - 1).astype(np.int64)
        self.click = cols["clicked"].astype(np.float32)
        self.qid = cols["query_id"].astype(np.int64)

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.pos[i], self.click[i], self.qid[i]


class PALRanker(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(n, emb_dim) for n in SPARSE.values()])
        d_in = emb_dim * len(SPARSE) + N_DENSE
        self.dense_bn = nn.LayerNorm(N_DENSE)
        self.mlp = nn.Sequential(nn.Linear(d_in, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1))
        self.pos_tower = nn.Embedding(MAX_POS, 1)

    def relevance(self, sparse, dense):
        e = [emb(sparse[:, i]) for i, emb in enumerate(self.embs)]
        return self.mlp(torch.cat(e + [self.dense_bn(dense)], dim=1)).squeeze(-1)

    def forward(self, sparse, dense, pos):
        return self.relevance(sparse, dense) + self.pos_tower(pos).squeeze(-1)


def ndcg10_by_query(qids, scores, clicks):
    order = np.lexsort((-scores, qids))
    q, s, c = qids[order], scores[order], clicks[order]
    bounds = np.flatnonzero(np.diff(q)) + 1
    disc = 1.0 / np.log2(np.arange(2, 12))
    total, n = 0.0, 0
    for grp in np.split(np.arange(len(q)), bounds):
        g = c[grp][:10]
        ideal = np.sort(c[grp])[::-1][:10]
        idcg = (ideal * disc[: len(ideal)]).sum()
        if idcg > 0:
            total += (g * disc[: len(g)]).sum() / idcg
            n += 1
    return total, n


@torch.no_grad()
def evaluate(raw, valid, device, rank, world):
    raw.eval()
    # shard by query so a query's impressions stay together on one rank
    idx = np.flatnonzero(valid.qid % world == rank)
    scores = []
    for i in range(0, len(idx), 65536):
        j = idx[i:i + 65536]
        s = raw.relevance(torch.from_numpy(valid.sparse[j]).to(device), torch.from_numpy(valid.dense[j]).to(device))
        scores.append(s.float().cpu().numpy())
    scores = np.concatenate(scores) if scores else np.zeros(0, np.float32)
    total, n = ndcg10_by_query(valid.qid[idx], scores, valid.click[idx])
    parts = [None] * world
    dist.all_gather_object(parts, (scores, valid.click[idx]))
    stats = torch.tensor([total, n], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    auc = roc_auc_score(np.concatenate([p[1] for p in parts]), np.concatenate([p[0] for p in parts]))
    raw.train()
    return auc, (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    t0 = time.time()
    train = Impressions(args.train)
    valid = Impressions(args.valid)
    if rank == 0:
        print(f"loaded {len(train):,} train / {len(valid):,} valid impressions in {time.time() - t0:.0f}s", flush=True)

    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = PALRanker(args.emb_dim).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    emb_params = [p for n, p in model.named_parameters() if "embs" in n]
    other = [p for n, p in model.named_parameters() if "embs" not in n]
    opt = torch.optim.Adam([{"params": emb_params, "lr": args.lr * 5}, {"params": other, "lr": args.lr}])

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for step, (sparse, dense, pos, click, _) in enumerate(loader):
            sparse, dense, pos, click = (x.to(device, non_blocking=True) for x in (sparse, dense, pos, click))
            logit = model(sparse, dense, pos)
            loss = F.binary_cross_entropy_with_logits(logit, click)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item()
            if rank == 0 and step % 500 == 0 and step:
                print(f"epoch {epoch} step {step}/{len(loader)} logloss {running / 500:.5f} "
                      f"{500 * args.batch_size * world / (time.time() - t0):.0f} imp/s", flush=True)
                running, t0 = 0.0, time.time()

        auc, ndcg = evaluate(model.module, valid, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} valid AUC {auc:.4f} NDCG@10 {ndcg:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "auc": auc, "ndcg": ndcg}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if ndcg > best:
                best = ndcg
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
