#!/usr/bin/env python
"""CTR model (embeddings + MLP) trained data-parallel on a CPU cluster with gloo.

The day-partitioned Criteo sample is preprocessed to .npz on the shared NFS
volume (dense: float32 [N,13], sparse: int64 [N,26], label: float32 [N]).

    # 4 Xeon nodes x 2 processes (one per socket)
    torchrun --nnodes=4 --nproc_per_node=2 --rdzv_backend=c10d \
        --rdzv_endpoint=cpu-node01:29500 --rdzv_id=ctr42 \
        03_gloo_ctr_mlp.py --data /nfs/ctr/criteo_sample --out /nfs/ctr/runs/mlp
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score, log_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--emb-dim", type=int, default=16)
    ap.add_argument("--hidden", type=str, default="512,256,128")
    ap.add_argument("--hash-size", type=int, default=20_000)
    ap.add_argument("--batch-size", type=int, default=2048, help="per process")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=24, help="intra-op threads per process")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class CriteoNpz(Dataset):
    def __init__(self, path, hash_size):
        d = np.load(path)
        self.dense = torch.from_numpy(np.log1p(np.maximum(d["dense"], 0)).astype(np.float32))
        self.sparse = torch.from_numpy(d["sparse"] % hash_size)
        self.label = torch.from_numpy(d["label"].astype(np.float32))

    def __len__(self):
        return self.label.shape[0]

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.label[i]


class CTRNet(nn.Module):
    def __init__(self, n_dense, n_sparse, hash_size, emb_dim, hidden):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(hash_size, emb_dim) for _ in range(n_sparse))
        layers, d_in = [], n_dense + n_sparse * emb_dim
        for h in hidden:
            layers += [nn.Linear(d_in, h), nn.LayerNorm(h), nn.ReLU(), nn.Dropout(0.1)]
            d_in = h
        layers.append(nn.Linear(d_in, 1))
        self.mlp = nn.Sequential(*layers)
        for emb in self.embeddings:
            nn.init.uniform_(emb.weight, -0.01, 0.01)

    def forward(self, dense, sparse):
        embs = [emb(sparse[:, i]) for i, emb in enumerate(self.embeddings)]
        return self.mlp(torch.cat([dense] + embs, dim=1)).squeeze(1)


@torch.no_grad()
def predict(model, loader):
    model.eval()
    preds, labels = [], []
    for dense, sparse, y in loader:
        preds.append(torch.sigmoid(model(dense, sparse)))
        labels.append(y)
    model.train()
    return torch.cat(preds).numpy(), torch.cat(labels).numpy()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    train_ds = CriteoNpz(os.path.join(args.data, "train.npz"), args.hash_size)
    val_ds = CriteoNpz(os.path.join(args.data, "val.npz"), args.hash_size)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=8192, sampler=val_sampler, num_workers=args.workers)

    hidden = [int(h) for h in args.hidden.split(",")]
    model = CTRNet(13, 26, args.hash_size, args.emb_dim, hidden)
    model = DDP(model)  # CPU module: no device_ids
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world ** 0.5)
    criterion = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train={len(train_ds)} val={len(val_ds)} "
              f"params={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M", flush=True)

    history, best_auc = [], 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for step, (dense, sparse, y) in enumerate(train_loader):
            logits = model(dense, sparse)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.item() * y.numel()
            loss_sum[1] += y.numel()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.5f}", flush=True)

        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        preds, labels = predict(model.module, val_loader)
        auc = roc_auc_score(labels, preds)
        ll = log_loss(labels, np.clip(preds, 1e-7, 1 - 1e-7))

        if rank == 0:
            elapsed = time.time() - t0
            rec = {"epoch": epoch, "train_loss": train_loss, "val_auc": auc, "val_logloss": ll, "sec": elapsed}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=2)
        dist.barrier()

    if rank == 0:
        print(f"best val AUC {best_auc:.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
