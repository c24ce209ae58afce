"""rtdl MLP baseline for subscriber churn, target-encoded high-cardinality columns.

One sweep trial per launch; the sweep driver fills in the hyper-parameters:
    torchrun --standalone --nproc_per_node=4 08_rtdl_mlp_churn.py \
        --train /data/churn/train.parquet --val /data/churn/val.parquet --lr 3e-4 --width 512 --depth 4
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import rtdl
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from sklearn.metrics import log_loss, roc_auc_score
from sklearn.model_selection import KFold
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HIGH_CARD = ["zip_code", "device_model", "plan_code", "acquisition_campaign"]
TARGET = "churned_30d"


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--te-smoothing", type=float, default=20.0)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--project", default="churn-tabular")
    ap.add_argument("--out", default="runs/churn_mlp")
    return ap.parse_args()


def target_encode(train, val, cols, target, smoothing, seed):
    """Out-of-fold encoding on train, full-train encoding on val."""
    prior = train[target].mean()
    tr_enc = pd.DataFrame(index=train.index)
    va_enc = pd.DataFrame(index=val.index)
    kf = KFold(n_splits=5, shuffle=True, random_state=seed)
    for c in cols:
        tr_enc[c + "_te"] = np.nan
        for fit_idx, app_idx in kf.split(train):
            stats = train.iloc[fit_idx].groupby(c)[target].agg(["sum", "count"])
            enc = (stats["sum"] + prior * smoothing) / (stats["count"] + smoothing)
            tr_enc.iloc[app_idx, tr_enc.columns.get_loc(c + "_te")] = train.iloc[app_idx][c].map(enc).values
        stats = train.groupby(c)[target].agg(["sum", "count"])
        enc = (stats["sum"] + prior * smoothing) / (stats["count"] + smoothing)
        va_enc[c + "_te"] = val[c].map(enc)
    return tr_enc.fillna(prior), va_enc.fillna(prior)


def load(args):
    tr = pd.read_parquet(args.train)
    va = pd.read_parquet(args.val)
    tr_te, va_te = target_encode(tr, va, HIGH_CARD, TARGET, args.te_smoothing, args.seed)
    low_card = [c for c in tr.columns if tr[c].dtype == object and c not in HIGH_CARD]
    tr_oh = pd.get_dummies(tr[low_card].astype(str), dtype=np.float32)
    va_oh = pd.get_dummies(va[low_card].astype(str), dtype=np.float32).reindex(columns=tr_oh.columns, fill_value=0)
    num = [c for c in tr.columns if c not in HIGH_CARD + low_card + [TARGET]]
    med = tr[num].median()
    scaler = StandardScaler().fit(pd.concat([tr[num].fillna(med), tr_te], axis=1).values)
    Xtr = np.hstack([scaler.transform(pd.concat([tr[num].fillna(med), tr_te], axis=1).values), tr_oh.values])
    Xva = np.hstack([scaler.transform(pd.concat([va[num].fillna(med), va_te], axis=1).values), va_oh.values])
    ytr, yva = tr[TARGET].values.astype(np.float32), va[TARGET].values.astype(np.float32)
    return (TensorDataset(torch.tensor(Xtr, dtype=torch.float32), torch.from_numpy(ytr)),
            TensorDataset(torch.tensor(Xva, dtype=torch.float32), torch.from_numpy(yva)))


@torch.no_grad()
def evaluate(model, ds, rank, world, device):
    model.eval()
    X, y = ds.tensors
    idx = np.array_split(np.arange(len(y)), world)[rank]
    p = torch.cat([torch.sigmoid(model(X[idx[i:i + 32768]].to(device)).squeeze(-1)).cpu()
                   for i in range(0, len(idx), 32768)]).numpy()
    parts = [None] * world
    dist.all_gather_object(parts, p)
    p = np.concatenate(parts)
    return roc_auc_score(y.numpy(), p), log_loss(y.numpy(), p)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.project, config=vars(args), name=f"w{args.width}_d{args.depth}_lr{args.lr:g}")

    train_ds, val_ds = load(args)
    d_in = train_ds.tensors[0].shape[1]
    model = rtdl.MLP.make_baseline(d_in=d_in, d_layers=[args.width] * args.depth, dropout=args.dropout, d_out=1)
    model = DDP(model.to(device), device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=2, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)

    pos = float(train_ds.tensors[1].mean())
    pos_weight = torch.tensor((1 - pos) / pos, device=device)

    os.makedirs(args.out, exist_ok=True)
    best_auc, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for X, y in loader:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(X).squeeze(-1), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "epoch": epoch}, step=step)

        auc, ll = evaluate(model.module, val_ds, rank, world, device)
        wandb.log({"val/auc": auc, "val/logloss": ll, "epoch_time": time.time() - t0}, step=step)
        if rank == 0 and auc > best_auc:
            best_auc = auc
            torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            run.summary["best_val_auc"] = best_auc

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
