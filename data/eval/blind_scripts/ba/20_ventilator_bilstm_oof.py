"""Google Brain - Ventilator Pressure Prediction.

4-layer BiLSTM on per-breath sequences (80 steps), engineered features, MAE on the inspiratory phase.
K-fold with OOF written to csv.
    torchrun --nproc_per_node=4 20_ventilator_bilstm_oof.py --epochs 200 --bs 256
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import GroupKFold
from sklearn.preprocessing import RobustScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SEQ = 80


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ventilator-pressure-prediction")
    p.add_argument("--out", default="./vent_bilstm")
    p.add_argument("--n-folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def add_features(df):
    df = df.copy()
    df["area"] = df.time_step * df.u_in
    df["area"] = df.groupby("breath_id").area.cumsum()
    df["u_in_cumsum"] = df.groupby("breath_id").u_in.cumsum()
    for lag in (1, 2, 3, 4):
        df[f"u_in_lag{lag}"] = df.groupby("breath_id").u_in.shift(lag).fillna(0)
        df[f"u_in_lead{lag}"] = df.groupby("breath_id").u_in.shift(-lag).fillna(0)
    df["u_in_diff1"] = df.u_in - df.u_in_lag1
    df["u_in_max"] = df.groupby("breath_id").u_in.transform("max")
    df["u_in_mean"] = df.groupby("breath_id").u_in.transform("mean")
    df["R_C"] = df.R.astype(str) + "_" + df.C.astype(str)
    df = pd.get_dummies(df, columns=["R", "C", "R_C"], dtype=np.float32)
    return df


class VentNet(nn.Module):
    def __init__(self, n_feat, hidden):
        super().__init__()
        self.fc_in = nn.Sequential(nn.Linear(n_feat, hidden), nn.LayerNorm(hidden), nn.GELU())
        self.lstm = nn.LSTM(hidden, hidden, num_layers=4, batch_first=True, bidirectional=True, dropout=0.1)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x):
        h, _ = self.lstm(self.fc_in(x))
        return self.head(h).squeeze(-1)


def masked_mae(pred, y, u_out):
    w = (u_out == 0).float()
    return (w * (pred - y).abs()).sum() / w.sum().clamp(min=1.0)


@torch.no_grad()
def predict_sharded(model, X, rank, world, device, bs=1024):
    """rank r predicts breaths r, r+world, ... ; results are gathered back into the original order."""
    model.eval()
    local_idx = torch.arange(rank, X.shape[0], world)
    preds = []
    for s in range(0, len(local_idx), bs):
        xb = X[local_idx[s:s + bs]].to(device, non_blocking=True)
        preds.append(model(xb))
    preds = torch.cat(preds)
    local_idx = local_idx.to(device)
    all_preds = [torch.zeros_like(preds) for _ in range(world)]
    all_idx = [torch.zeros_like(local_idx) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_idx, local_idx)
    out = torch.empty((X.shape[0], SEQ), device=device)
    out[torch.cat(all_idx)] = torch.cat(all_preds)
    return out.cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train = pd.read_csv(os.path.join(args.data, "train.csv"))
    feats_df = add_features(train)
    breath_ids = train.breath_id.values.reshape(-1, SEQ)[:, 0]
    y = train.pressure.values.reshape(-1, SEQ).astype(np.float32)
    u_out = train.u_out.values.reshape(-1, SEQ).astype(np.float32)
    feat_cols = [c for c in feats_df.columns if c not in ("id", "breath_id", "pressure")]
    X = RobustScaler().fit_transform(feats_df[feat_cols].values).astype(np.float32).reshape(-1, SEQ, len(feat_cols))
    if rank == 0:
        print(f"{X.shape[0]} breaths, {X.shape[2]} features, world {world}", flush=True)

    X_t, y_t, u_t = torch.from_numpy(X), torch.from_numpy(y), torch.from_numpy(u_out)
    oof = np.zeros_like(y)
    gkf = GroupKFold(n_splits=args.n_folds)
    scores = []
    for fold, (tr, va) in enumerate(gkf.split(X, y, groups=breath_ids)):
        ds = TensorDataset(X_t[tr], y_t[tr], u_t[tr])
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
        dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)

        model = DDP(VentNet(X.shape[2], args.hidden).to(device), device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50, eta_min=1e-6)

        best, best_pred = np.inf, None
        t0 = time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for i, (xb, yb, ub) in enumerate(dl):
                xb, yb, ub = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True), ub.to(device)
                loss = masked_mae(model(xb), yb, ub)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step(epoch + i / len(dl))

            if epoch % 5 == 4 or epoch == args.epochs - 1:
                pred = predict_sharded(model.module, X_t[va], rank, world, device)
                mae = float(np.sum(np.abs(pred - y[va]) * (u_out[va] == 0)) / np.sum(u_out[va] == 0))
                if mae < best:
                    best, best_pred = mae, pred
                    if rank == 0:
                        torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.pt"))
                if rank == 0:
                    print(f"fold {fold} epoch {epoch} val MAE {mae:.4f} best {best:.4f} ({time.time() - t0:.0f}s)",
                          flush=True)
        oof[va] = best_pred
        scores.append(best)
        dist.barrier()

    if rank == 0:
        mask = u_out == 0
        cv = float(np.abs(oof - y)[mask].mean())
        pd.DataFrame({"id": train.id.values, "breath_id": train.breath_id.values, "pressure": y.ravel(),
                      "oof": oof.ravel()}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
        print(f"fold MAE {np.round(scores, 4)}  CV MAE {cv:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
