#!/usr/bin/env python
"""DLRM on Criteo Kaggle Display Advertising (train.txt, 45M rows), DDP.

Categorical values with fewer than --min-count occurrences are mapped to a
shared OOV id per feature (feature-count vocabularies). The processed arrays are
cached next to the raw file so later runs start in seconds.

    torchrun --nproc_per_node=4 07_dlrm_kaggle_criteo.py --raw /data/criteo_kaggle/train.txt
"""
import argparse
import os
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

N_DENSE, N_CAT = 13, 26


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--min-count", type=int, default=4)
    ap.add_argument("--emb-dim", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--val-days", type=int, default=1, help="last N of 7 days held out")
    ap.add_argument("--save", default="ckpt/dlrm_kaggle.pt")
    return ap.parse_args()


def preprocess(raw_path, min_count):
    counters = [Counter() for _ in range(N_CAT)]
    n = 0
    with open(raw_path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            for j in range(N_CAT):
                counters[j][parts[1 + N_DENSE + j]] += 1
            n += 1
    vocabs = []
    for c in counters:
        keep = sorted(k for k, v in c.items() if v >= min_count and k != "")
        vocabs.append({k: i + 1 for i, k in enumerate(keep)})  # 0 = OOV / missing
    dense = np.zeros((n, N_DENSE), dtype=np.float32)
    cat = np.zeros((n, N_CAT), dtype=np.int32)
    label = np.zeros(n, dtype=np.float32)
    with open(raw_path) as f:
        for i, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            label[i] = float(parts[0])
            for j in range(N_DENSE):
                v = parts[1 + j]
                dense[i, j] = np.log1p(max(float(v), 0.0)) if v else 0.0
            for j in range(N_CAT):
                cat[i, j] = vocabs[j].get(parts[1 + N_DENSE + j], 0)
    sizes = np.array([len(v) + 1 for v in vocabs], dtype=np.int64)
    return dense, cat, label, sizes


def load_or_build(raw_path, min_count):
    cache = f"{os.path.splitext(raw_path)[0]}_mc{min_count}.npz"
    if not os.path.exists(cache):
        t0 = time.time()
        dense, cat, label, sizes = preprocess(raw_path, min_count)
        np.savez(cache, dense=dense, cat=cat, label=label, sizes=sizes)
        print(f"preprocessed {len(label)} rows in {time.time() - t0:.0f}s -> {cache}", flush=True)
    z = np.load(cache)
    return z["dense"], z["cat"], z["label"], z["sizes"]


class DotInteraction(nn.Module):
    def forward(self, dense_x, emb_list):
        t = torch.stack([dense_x] + emb_list, dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        n = t.size(1)
        li, lj = torch.tril_indices(n, n, offset=-1, device=t.device)
        return torch.cat([dense_x, z[:, li, lj]], dim=1)


class DLRM(nn.Module):
    def __init__(self, table_sizes, dim):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(int(s), dim) for s in table_sizes])
        self.bot = nn.Sequential(nn.Linear(N_DENSE, 512), nn.ReLU(), nn.Linear(512, 256),
                                 nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        self.inter = DotInteraction()
        f = N_CAT + 1
        self.top = nn.Sequential(nn.Linear(dim + f * (f - 1) // 2, 512), nn.ReLU(),
                                 nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense, cat):
        x = self.bot(dense)
        embs = [e(cat[:, j]) for j, e in enumerate(self.embs)]
        return self.top(self.inter(x, embs)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    for dense, cat, y in loader:
        p = torch.sigmoid(model(dense.to(device), cat.to(device).long()))
        preds.append(p)
        labels.append(y.to(device))
    preds, labels = torch.cat(preds), torch.cat(labels)
    # gather variable-length shards from all ranks
    n = torch.tensor([preds.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    m = int(max(s.item() for s in sizes))
    pad_p = torch.zeros(m, device=device)
    pad_l = torch.zeros(m, device=device)
    pad_p[: preds.numel()] = preds
    pad_l[: labels.numel()] = labels
    gp = [torch.zeros_like(pad_p) for _ in sizes]
    gl = [torch.zeros_like(pad_l) for _ in sizes]
    dist.all_gather(gp, pad_p)
    dist.all_gather(gl, pad_l)
    p = torch.cat([g[: int(s.item())] for g, s in zip(gp, sizes)]).cpu().numpy()
    l = torch.cat([g[: int(s.item())] for g, s in zip(gl, sizes)]).cpu().numpy()
    model.train()
    return roc_auc_score(l, p)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    dense, cat, label, sizes = load_or_build(args.raw, args.min_count)
    n = len(label)
    n_val = n * args.val_days // 7
    train_ds = TensorDataset(torch.from_numpy(dense[: n - n_val]), torch.from_numpy(cat[: n - n_val]),
                             torch.from_numpy(label[: n - n_val]))
    val_ds = TensorDataset(torch.from_numpy(dense[n - n_val:]), torch.from_numpy(cat[n - n_val:]),
                           torch.from_numpy(label[n - n_val:]))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=16384, num_workers=2, pin_memory=True)

    torch.manual_seed(0)
    model = DLRM(sizes, args.emb_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for i, (d, c, y) in enumerate(train_loader):
            d, c, y = d.to(device, non_blocking=True), c.to(device, non_blocking=True).long(), y.to(device, non_blocking=True)
            loss = loss_fn(model(d, c), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
            if (i + 1) % 1000 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"epoch {epoch} it {i + 1}/{len(train_loader)} "
                          f"loss {(running[0] / running[1]).item():.5f} "
                          f"({time.time() - t0:.0f}s)", flush=True)
                running.zero_()

        auc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val AUC {auc:.5f}", flush=True)
            os.makedirs(os.path.dirname(args.save), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "sizes": sizes, "epoch": epoch}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
