"""
Credit-card fraud detection (Kaggle creditcard.csv) with an MLP, DDP over local GPUs.
The data is heavily imbalanced, so the loss is class-weighted.

    python 08_tabular_mlp_ddp.py --csv creditcard.csv --world_size 4
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="creditcard.csv")
    p.add_argument("--world_size", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=2048, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--ckpt", default="fraud_mlp.pt")
    return p.parse_args()


class MLP(nn.Module):
    def __init__(self, d_in, hidden, n_classes=2, p=0.2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(p),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(p),
            nn.Linear(hidden, hidden // 2), nn.ReLU(),
            nn.Linear(hidden // 2, n_classes),
        )

    def forward(self, x):
        return self.net(x)


def load_data(csv_path, seed):
    df = pd.read_csv(csv_path)
    y = df["Class"].values.astype(np.int64)
    X = df.drop(columns=["Class", "Time"]).values.astype(np.float32)
    X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, stratify=y, random_state=seed)
    scaler = StandardScaler().fit(X_tr)
    X_tr = scaler.transform(X_tr).astype(np.float32)
    X_va = scaler.transform(X_va).astype(np.float32)
    return X_tr, y_tr, X_va, y_va


def gather_predictions(probs, labels, world_size):
    # pad to a common length so all_gather works with uneven shards
    n = torch.tensor([probs.numel()], device=probs.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    pad_p = torch.zeros(max_n, device=probs.device)
    pad_l = torch.zeros(max_n, dtype=labels.dtype, device=labels.device)
    pad_p[: probs.numel()] = probs
    pad_l[: labels.numel()] = labels
    all_p = [torch.zeros_like(pad_p) for _ in range(world_size)]
    all_l = [torch.zeros_like(pad_l) for _ in range(world_size)]
    dist.all_gather(all_p, pad_p)
    dist.all_gather(all_l, pad_l)
    out_p = torch.cat([p[: int(s.item())] for p, s in zip(all_p, sizes)])
    out_l = torch.cat([l[: int(s.item())] for l, s in zip(all_l, sizes)])
    return out_p.cpu().numpy(), out_l.cpu().numpy()


def run(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)

    X_tr, y_tr, X_va, y_va = load_data(args.csv, args.seed)
    train_ds = TensorDataset(torch.from_numpy(X_tr), torch.from_numpy(y_tr))
    val_ds = TensorDataset(torch.from_numpy(X_va), torch.from_numpy(y_va))
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    per_gpu = args.batch_size // world_size
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, drop_last=True)
    # strided shard of the validation set, no padding, so AP is computed on every row exactly once
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))
    val_loader = DataLoader(val_shard, batch_size=8192, shuffle=False)

    model = MLP(X_tr.shape[1], args.hidden).to(rank)
    model = DDP(model, device_ids=[rank])

    counts = np.bincount(y_tr, minlength=2)
    class_weights = torch.tensor(len(y_tr) / (2.0 * counts), dtype=torch.float32).cuda()
    criterion = nn.CrossEntropyLoss(weight=class_weights)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)

    best_ap = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=rank)
        for xb, yb in train_loader:
            xb, yb = xb.to(rank), yb.to(rank)
            optimizer.zero_grad()
            loss = criterion(model(xb), yb)
            loss.backward()
            optimizer.step()
            tot[0] += loss.detach() * yb.size(0)
            tot[1] += yb.size(0)
        dist.all_reduce(tot)

        model.eval()
        probs, labels = [], []
        with torch.no_grad():
            for xb, yb in val_loader:
                xb = xb.to(rank)
                probs.append(torch.softmax(model(xb), dim=1)[:, 1])
                labels.append(yb.to(rank))
        p_all, l_all = gather_predictions(torch.cat(probs), torch.cat(labels), world_size)
        ap = average_precision_score(l_all, p_all)
        auc = roc_auc_score(l_all, p_all)
        scheduler.step(ap)  # same value on every rank

        if rank == 0:
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} "
                  f"val AP {ap:.4f} AUC {auc:.4f} ({time.time() - t0:.1f}s)")
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "ap": ap}, args.ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)
