#!/usr/bin/env python
"""Telco customer churn - TabTransformer, 5-fold CV, DDP, Weights & Biases tracking.

    torchrun --nproc_per_node=2 05_telco_churn_tabtr_wandb.py --csv data/telco_churn.csv --wandb-project churn
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CATS = ["gender", "SeniorCitizen", "Partner", "Dependents", "PhoneService", "MultipleLines",
        "InternetService", "OnlineSecurity", "OnlineBackup", "DeviceProtection", "TechSupport",
        "StreamingTV", "StreamingMovies", "Contract", "PaperlessBilling", "PaymentMethod"]
NUMS = ["tenure", "MonthlyCharges", "TotalCharges"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--wandb-project", default="churn-tabtr")
    ap.add_argument("--out", default="out/churn_tabtr")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=128, help="per process")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--embed-dim", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


class ChurnData(Dataset):
    def __init__(self, cat, num, y):
        self.cat, self.num, self.y = cat, num, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (torch.from_numpy(self.cat[i]), torch.from_numpy(self.num[i]),
                torch.tensor(self.y[i], dtype=torch.float32), i)


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim, depth, heads, attn_drop=0.1, ff_drop=0.1):
        super().__init__()
        self.cat_embed = nn.ModuleList(nn.Embedding(c, dim) for c in cards)
        self.col_embed = nn.Parameter(torch.randn(len(cards), dim) * 0.02)  # shared column identity
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, ff_drop, batch_first=True)
        layer.self_attn.dropout = attn_drop
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.cont_norm = nn.LayerNorm(n_num)
        d = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.SELU(), nn.Linear(d, d // 2), nn.SELU(),
                                 nn.Linear(d // 2, 1))

    def forward(self, x_cat, x_num):
        e = torch.stack([emb(x_cat[:, j]) for j, emb in enumerate(self.cat_embed)], 1) + self.col_embed
        ctx = self.encoder(e).flatten(1)
        return self.mlp(torch.cat([ctx, self.cont_norm(x_num)], 1)).squeeze(1)


def load(csv):
    df = pd.read_csv(csv)
    df["TotalCharges"] = pd.to_numeric(df["TotalCharges"], errors="coerce").fillna(0.0)
    df["Churn"] = (df["Churn"] == "Yes").astype(np.float32)
    card = []
    for c in CATS:
        levels = sorted(df[c].astype(str).unique())
        df[c] = df[c].astype(str).map({v: k for k, v in enumerate(levels)}).astype(np.int64)
        card.append(len(levels))
    df[NUMS] = np.log1p(df[NUMS].astype(np.float32))
    return df, card


@torch.no_grad()
def gather_fold_predictions(model, loader, n, device):
    model.eval()
    ids, probs = [], []
    for xc, xn, _, i in loader:
        probs.append(torch.sigmoid(model(xc.to(device), xn.to(device))).cpu())
        ids.append(i)
    local = (torch.cat(ids).numpy(), torch.cat(probs).numpy())
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    out = np.zeros(n, dtype=np.float32)
    for i, p in everything:
        out[i] = p
    return out


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, config=vars(args), job_type="cv",
                     name=f"tabtr-d{args.embed_dim}-L{args.depth}")

    df, cards = load(args.csv)
    y = df["Churn"].values
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    oof = np.zeros(len(df), dtype=np.float32)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for fold, (tr_idx, va_idx) in enumerate(skf.split(df, y)):
        tr, va = df.iloc[tr_idx], df.iloc[va_idx]
        mu, sd = tr[NUMS].mean(), tr[NUMS].std()
        mk = lambda f: ChurnData(f[CATS].values, ((f[NUMS] - mu) / sd).values.astype(np.float32), f["Churn"].values)
        tr_ds, va_ds = mk(tr), mk(va)
        tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
        tr_loader = DataLoader(tr_ds, batch_size=args.batch_size, sampler=tr_sampler, num_workers=2, drop_last=True)
        va_loader = DataLoader(va_ds, batch_size=512, sampler=DistributedSampler(va_ds, shuffle=False), num_workers=2)

        model = DDP(TabTransformer(cards, len(NUMS), args.embed_dim, args.depth, args.heads).to(device),
                    device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world ** 0.5, weight_decay=1e-4)  # sqrt scaling for Adam
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=4)
        pos_weight = torch.tensor([(1 - tr["Churn"].mean()) / tr["Churn"].mean()], device=device)
        crit = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

        best = 0.0
        for epoch in range(args.epochs):
            tr_sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            loss_sum = torch.zeros((), device=device)
            for xc, xn, yb, _ in tr_loader:
                out = model(xc.to(device, non_blocking=True), xn.to(device, non_blocking=True))
                loss = crit(out, yb.to(device, non_blocking=True))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach()
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            pred = gather_fold_predictions(model.module, va_loader, len(va_ds), device)
            auc = roc_auc_score(va["Churn"], pred)
            ap = average_precision_score(va["Churn"], pred)
            sched.step(auc)
            run.log({f"fold{fold}/train_loss": loss_sum.item() / len(tr_loader), f"fold{fold}/val_auc": auc,
                     f"fold{fold}/val_ap": ap, f"fold{fold}/lr": opt.param_groups[0]["lr"],
                     f"fold{fold}/epoch_time": time.time() - t0})
            if auc > best:
                best = auc
                oof[va_idx] = pred
                if rank == 0:
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.pt"))
        run.summary[f"fold{fold}_best_auc"] = best
        if rank == 0:
            print(f"fold {fold}: best val auc {best:.4f}")

    cv_auc = roc_auc_score(y, oof)
    run.summary["oof_auc"] = cv_auc
    if rank == 0:
        print(f"OOF AUC {cv_auc:.4f}")
        pd.DataFrame({"customerID": df["customerID"], "oof": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
    run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
