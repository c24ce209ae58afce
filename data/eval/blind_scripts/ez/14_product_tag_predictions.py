#!/usr/bin/env python
"""One-vs-all tag head on frozen product embeddings (from the upstream catalog encoder).

After every epoch the test predictions (top-100 tags + scores per product) are
collected on rank 0, written as a sparse score matrix for the offline dashboards,
and scored with pyxclib (P@k, nDCG@k, PSP@k).

    torchrun --nproc_per_node=8 14_product_tag_predictions.py \
        --emb-dir /mnt/shared/tagging/emb_v3 --labels-dir /mnt/shared/tagging/catalog_v7 \
        --out /mnt/shared/tagging/runs/ova_head
"""
import argparse
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from xclib.evaluation import xc_metrics


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emb-dir", required=True)
    ap.add_argument("--labels-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--global-batch-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class OVAHead(nn.Module):
    def __init__(self, in_dim, hidden, num_labels):
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden), nn.GELU(),
                                 nn.Dropout(0.1))
        self.clf = nn.Linear(hidden, num_labels)

    def forward(self, x):
        return self.clf(self.mlp(x))


def dense_rows(Y, rows, device):
    sub = Y[rows]
    out = torch.zeros(len(rows), Y.shape[1], device=device)
    r = np.repeat(np.arange(len(rows)), np.diff(sub.indptr))
    out[torch.from_numpy(r).to(device), torch.from_numpy(sub.indices.astype(np.int64)).to(device)] = 1.0
    return out


@torch.no_grad()
def predict_shard(net, X_te, rows, topk, device, bs=4096):
    net.eval()
    scores, idx = [], []
    for s in range(0, len(rows), bs):
        x = torch.from_numpy(X_te[rows[s:s + bs]]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        v, i = torch.sigmoid(logits.float()).topk(topk, dim=1)
        scores.append(v)
        idx.append(i)
    net.train()
    return torch.cat(scores), torch.cat(idx)


def gather_to_rank0(t, world):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return parts


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    X_tr = np.load(os.path.join(args.emb_dir, "train.npy"), mmap_mode="r")
    X_te = np.load(os.path.join(args.emb_dir, "test.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(args.labels_dir, "Y_train.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.labels_dir, "Y_test.npz")).tocsr()
    num_labels, in_dim = Y_tr.shape[1], X_tr.shape[1]
    inv_prop = xc_metrics.compute_inv_propesity(Y_tr, A=0.55, B=1.5)

    train_ds = TensorDataset(torch.arange(X_tr.shape[0]))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                        drop_last=True)
    test_rows = np.arange(rank, X_te.shape[0], world)

    net = OVAHead(in_dim, args.hidden, num_labels).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_p1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (rows,) in enumerate(loader):
            rows = np.sort(rows.numpy())
            x = torch.from_numpy(X_tr[rows]).to(device, non_blocking=True)
            y = dense_rows(Y_tr, rows, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, reduction="sum") / len(rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        scores, idx = predict_shard(net, X_te, test_rows, args.topk, device)
        all_scores = gather_to_rank0(scores, world)
        all_idx = gather_to_rank0(idx, world)
        if rank == 0:
            n = X_te.shape[0]
            order = np.concatenate([np.arange(r, n, world) for r in range(world)])
            S = torch.cat(all_scores).cpu().numpy()
            I = torch.cat(all_idx).cpu().numpy()
            pred = sp.csr_matrix((S.ravel(), (np.repeat(order, args.topk), I.ravel())),
                                 shape=(n, num_labels))
            metrics = xc_metrics.Metrics(true_labels=Y_te, inv_psp=inv_prop)
            prec, ndcg, psp, psndcg = metrics.eval(pred, 5)
            print(f"epoch {epoch} P@1/3/5 {prec[0]:.4f}/{prec[2]:.4f}/{prec[4]:.4f} "
                  f"nDCG@5 {ndcg[4]:.4f} PSP@5 {psp[4]:.4f}", flush=True)
            sp.save_npz(os.path.join(args.out, f"test_scores_ep{epoch}.npz"), pred)
            if prec[0] > best_p1:
                best_p1 = prec[0]
                torch.save(net.state_dict(), os.path.join(args.out, "best_head.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
