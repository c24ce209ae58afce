#!/usr/bin/env python
"""DLRM on the Criteo Terabyte day-split, data-parallel over 8 GPUs.

Embedding tables are small enough (hashed to 1M rows each) to be replicated, so
the whole model is wrapped in DDP. Input is the preprocessed numpy layout
produced by the reference dlrm repo (dense_*.npy, sparse_*.npy, label_*.npy).

    torchrun --nproc_per_node=8 01_dlrm_criteo_auc.py --data /data/criteo_tb/npy \
        --batch-size 8192 --epochs 1
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("dlrm")

NUM_DENSE = 13
NUM_SPARSE = 26


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/dlrm")
    p.add_argument("--batch-size", type=int, default=8192, help="per-GPU batch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--emb-dim", type=int, default=128)
    p.add_argument("--hash-size", type=int, default=1_000_000)
    p.add_argument("--bottom-mlp", default="512,256,128")
    p.add_argument("--top-mlp", default="1024,1024,512,256,1")
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class CriteoNpy(Dataset):
    def __init__(self, root, split, hash_size):
        self.dense = np.load(os.path.join(root, f"dense_{split}.npy"), mmap_mode="r")
        self.sparse = np.load(os.path.join(root, f"sparse_{split}.npy"), mmap_mode="r")
        self.label = np.load(os.path.join(root, f"label_{split}.npy"), mmap_mode="r")
        self.hash_size = hash_size

    def __len__(self):
        return self.label.shape[0]

    def __getitem__(self, idx):
        dense = np.log1p(np.maximum(self.dense[idx].astype(np.float32), 0.0))
        sparse = self.sparse[idx].astype(np.int64) % self.hash_size
        return (torch.from_numpy(dense), torch.from_numpy(sparse),
                torch.tensor(self.label[idx], dtype=torch.float32))


def mlp(sizes, sigmoid_last=False):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU(inplace=True))
    if sigmoid_last:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, emb_dim, hash_size, bottom, top):
        super().__init__()
        self.embs = nn.ModuleList(
            [nn.EmbeddingBag(hash_size, emb_dim, mode="sum") for _ in range(NUM_SPARSE)]
        )
        for e in self.embs:
            nn.init.uniform_(e.weight, -1.0 / np.sqrt(hash_size), 1.0 / np.sqrt(hash_size))
        self.bottom = mlp([NUM_DENSE] + bottom)
        n_feat = NUM_SPARSE + 1
        n_inter = n_feat * (n_feat - 1) // 2
        self.top = mlp([n_inter + emb_dim] + top)
        li, lj = torch.tril_indices(n_feat, n_feat, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        offsets = torch.arange(sparse.size(0), device=sparse.device)
        ly = [emb(sparse[:, i], offsets) for i, emb in enumerate(self.embs)]
        t = torch.stack([x] + ly, dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        inter = z[:, self.li, self.lj]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    for dense, sparse, y in loader:
        dense = dense.to(device, non_blocking=True)
        sparse = sparse.to(device, non_blocking=True)
        logits = model(dense, sparse)
        preds.append(torch.sigmoid(logits).float().cpu())
        labels.append(y)
    model.train()
    preds = torch.cat(preds).numpy()
    labels = torch.cat(labels).numpy()
    auc = roc_auc_score(labels, preds)
    logloss = float(nn.functional.binary_cross_entropy(
        torch.from_numpy(preds).clamp(1e-7, 1 - 1e-7), torch.from_numpy(labels)))
    return auc, logloss


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    torch.manual_seed(1234)

    train_ds = CriteoNpy(args.data, "train", args.hash_size)
    val_ds = CriteoNpy(args.data, "val", args.hash_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    bottom = [int(x) for x in args.bottom_mlp.split(",")]
    top = [int(x) for x in args.top_mlp.split(",")]
    assert bottom[-1] == args.emb_dim
    model = DLRM(args.emb_dim, args.hash_size, bottom, top).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for dense, sparse, y in train_loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = criterion(model(dense, sparse), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if step % 100 == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                sps = 100 * args.batch_size * world / (time.time() - t0)
                logger.info("epoch %d step %d loss %.5f  %.0f samples/s",
                            epoch, step, loss_avg.item(), sps)
                t0 = time.time()

            if step % args.eval_every == 0:
                auc, ll = evaluate(model, val_loader, device)
                logger.info("step %d  val AUC %.5f  logloss %.5f", step, auc, ll)
                if rank == 0 and auc > best_auc:
                    best_auc = auc
                    torch.save({"model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(),
                                "step": step, "auc": auc},
                               os.path.join(args.out, "best.pt"))

    auc, ll = evaluate(model, val_loader, device)
    logger.info("final val AUC %.5f logloss %.5f (best %.5f)", auc, ll, max(best_auc, auc))
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step},
                   os.path.join(args.out, "last.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
