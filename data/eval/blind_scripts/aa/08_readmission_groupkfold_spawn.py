"""30-day readmission risk model, 5-fold GroupKFold by patient, DDP via mp.spawn.

    python 08_readmission_groupkfold_spawn.py --csv data/encounters.csv --world-size 4 --out runs/readmit
"""
import argparse
import json
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CATEGORICAL = ["admission_type", "discharge_disposition", "admission_source", "payer_code",
               "medical_specialty", "primary_diag_group", "race", "gender", "age_bucket"]
NUMERIC = ["time_in_hospital", "num_lab_procedures", "num_procedures", "num_medications",
           "number_outpatient", "number_emergency", "number_inpatient", "number_diagnoses"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="runs/readmit")
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--bs", type=int, default=4096, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=512)
    return p.parse_args()


def featurize(path):
    df = pd.read_csv(path, na_values=["?", "Unknown/Invalid"])
    df = df[~df["discharge_disposition"].isin([11, 19, 20, 21])]  # expired / hospice
    df["label"] = (df["readmitted"] == "<30").astype(np.float32)
    for c in CATEGORICAL:
        df[c] = df[c].astype(str).fillna("NA")
        rare = df[c].value_counts()
        df.loc[df[c].map(rare) < 30, c] = "RARE"
    X_cat = pd.get_dummies(df[CATEGORICAL], dtype=np.float32)
    X_num = np.log1p(df[NUMERIC].fillna(0).clip(lower=0).astype(np.float32))
    X = np.concatenate([X_num.values, X_cat.values], axis=1).astype(np.float32)
    return X, df["label"].values, df["patient_nbr"].values


class RiskNet(nn.Module):
    def __init__(self, d_in, hidden):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.3),
            nn.Linear(hidden, hidden // 2), nn.LayerNorm(hidden // 2), nn.GELU(), nn.Dropout(0.3),
            nn.Linear(hidden // 2, 1),
        )

    def forward(self, x):
        return self.body(x).squeeze(-1)


def predict(model, loader, device):
    model.eval()
    probs, ys = [], []
    with torch.no_grad():
        for x, y in loader:
            probs.append(torch.sigmoid(model(x.to(device, non_blocking=True))).cpu())
            ys.append(y)
    return torch.cat(probs).numpy(), torch.cat(ys).numpy()


def run_fold(fold, tr_idx, va_idx, X, y, args, rank, world_size, device):
    # standardize numeric columns with train-fold statistics only
    mu = X[tr_idx, : len(NUMERIC)].mean(0)
    sd = X[tr_idx, : len(NUMERIC)].std(0) + 1e-6
    Xf = X.copy()
    Xf[:, : len(NUMERIC)] = (Xf[:, : len(NUMERIC)] - mu) / sd

    train_ds = TensorDataset(torch.from_numpy(Xf[tr_idx]), torch.from_numpy(y[tr_idx]))
    val_ds = TensorDataset(torch.from_numpy(Xf[va_idx]), torch.from_numpy(y[va_idx]))
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=fold)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs // world_size, sampler=train_sampler, drop_last=True, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=4096, sampler=val_sampler, pin_memory=True)

    torch.manual_seed(1000 + fold)
    model = DDP(RiskNet(X.shape[1], args.hidden).to(device), device_ids=[device.index])
    pos_rate = float(y[tr_idx].mean())
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_rate) / pos_rate, device=device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_dl))

    best = {"auc": 0.0}
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for xb, yb in train_dl:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = criterion(model(xb), yb)
            loss.backward()
            opt.step()
            sched.step()

        probs, ys = predict(model, val_dl, device)
        auc = roc_auc_score(ys, probs)
        ap = average_precision_score(ys, probs)
        if rank == 0:
            print(f"fold {fold} epoch {epoch:02d} loss {loss.item():.4f} val_auc {auc:.4f} val_ap {ap:.4f}", flush=True)
            if auc > best["auc"]:
                best = {"auc": auc, "ap": ap, "epoch": epoch}
                torch.save({"model": model.module.state_dict(), "mu": mu, "sd": sd},
                           os.path.join(args.out, f"fold{fold}.pt"))
    return best


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29611")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    X, y, groups = featurize(args.csv)
    if rank == 0:
        print(f"{X.shape[0]} encounters, {X.shape[1]} features, positive rate {y.mean():.3f}", flush=True)
    results = []
    for fold, (tr_idx, va_idx) in enumerate(GroupKFold(n_splits=args.folds).split(X, y, groups)):
        res = run_fold(fold, tr_idx, va_idx, X, y, args, rank, world_size, device)
        results.append(res)
        dist.barrier()

    if rank == 0:
        summary = {"folds": results,
                   "mean_auc": float(np.mean([r["auc"] for r in results])),
                   "mean_ap": float(np.mean([r["ap"] for r in results]))}
        print(json.dumps(summary, indent=2))
        with open(os.path.join(args.out, "cv_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
