"""
Telecom customer churn prediction - residual MLP on one-hot + scaled numeric features.
Moved from the notebook to torchrun because the hyper-parameter sweep takes forever on 1 GPU.

    torchrun --nproc_per_node=4 15_churn_tabular_ddp.py --csv data/telco_churn.csv --epochs 100
"""
import argparse
import json
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.compose import ColumnTransformer
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

NUMERIC = ["tenure", "MonthlyCharges", "TotalCharges"]
CATEGORICAL = ["gender", "SeniorCitizen", "Partner", "Dependents", "PhoneService", "MultipleLines",
               "InternetService", "OnlineSecurity", "OnlineBackup", "DeviceProtection", "TechSupport",
               "StreamingTV", "StreamingMovies", "Contract", "PaperlessBilling", "PaymentMethod"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/telco_churn.csv")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--early_stop", type=int, default=15)
    p.add_argument("--out_dir", default="churn_out")
    return p.parse_args()


def load_data(csv):
    df = pd.read_csv(csv)
    df["TotalCharges"] = pd.to_numeric(df["TotalCharges"], errors="coerce").fillna(0.0)
    y = (df["Churn"] == "Yes").astype(np.float32).values
    X_train, X_val, y_train, y_val = train_test_split(df, y, test_size=0.2, stratify=y, random_state=7)
    ct = ColumnTransformer([
        ("num", StandardScaler(), NUMERIC),
        ("cat", OneHotEncoder(handle_unknown="ignore", sparse_output=False), CATEGORICAL),
    ])
    X_train = ct.fit_transform(X_train).astype(np.float32)
    X_val = ct.transform(X_val).astype(np.float32)
    return (TensorDataset(torch.from_numpy(X_train), torch.from_numpy(y_train)),
            TensorDataset(torch.from_numpy(X_val), torch.from_numpy(y_val)),
            X_train.shape[1])


class ResBlock(nn.Module):
    def __init__(self, dim, dropout):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(),
                                 nn.Dropout(dropout), nn.Linear(dim * 2, dim))

    def forward(self, x):
        return x + self.net(x)


class ChurnNet(nn.Module):
    def __init__(self, in_dim, hidden, blocks, dropout):
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.blocks = nn.Sequential(*[ResBlock(hidden, dropout) for _ in range(blocks)])
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x))).squeeze(-1)


def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    tp = fp = fn = 0
    bce = nn.BCEWithLogitsLoss(reduction="sum")
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss_sum += bce(logits, y).item()
            pred = (logits > 0).float()
            correct += (pred == y).sum().item()
            tp += ((pred == 1) & (y == 1)).sum().item()
            fp += ((pred == 1) & (y == 0)).sum().item()
            fn += ((pred == 0) & (y == 1)).sum().item()
            n += y.numel()
    # combine the shards from all ranks
    stats = torch.tensor([loss_sum, correct, tp, fp, fn, n], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_sum, correct, tp, fp, fn, n = stats.tolist()
    precision = tp / max(tp + fp, 1)
    recall = tp / max(tp + fn, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-8)
    return {"loss": loss_sum / n, "acc": correct / n, "precision": precision, "recall": recall, "f1": f1}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, val_ds, in_dim = load_data(args.csv)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=512)

    model = ChurnNet(in_dim, args.hidden, args.blocks, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    pos_frac = train_ds.tensors[1].mean().item()
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_frac) / pos_frac, device=device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"in_dim={in_dim}, train={len(train_ds)}, val={len(val_ds)}, churn rate={pos_frac:.3f}")

    best_f1, since_best, log = -1.0, 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        scheduler.step()

        metrics = evaluate(model.module, val_loader, device)
        metrics["epoch"] = epoch
        log.append(metrics)
        if metrics["f1"] > best_f1:
            best_f1, since_best = metrics["f1"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "churn_best.pt"))
        else:
            since_best += 1

        if rank == 0 and epoch % 5 == 0:
            print(f"epoch {epoch:3d} | val loss {metrics['loss']:.4f} acc {metrics['acc']:.4f} "
                  f"P {metrics['precision']:.3f} R {metrics['recall']:.3f} F1 {metrics['f1']:.4f}")
        if since_best >= args.early_stop:
            if rank == 0:
                print(f"no F1 improvement for {args.early_stop} epochs, stopping at epoch {epoch}")
            break

    if rank == 0:
        with open(os.path.join(args.out_dir, "val_log.json"), "w") as f:
            json.dump(log, f, indent=1)
        print(f"best val F1 {best_f1:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
