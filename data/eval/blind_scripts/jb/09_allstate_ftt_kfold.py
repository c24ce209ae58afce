"""Allstate claims severity: FT-Transformer regression on log(loss + 200), k-fold, DDP.

    torchrun --nproc_per_node=4 09_allstate_ftt_kfold.py --data data/allstate --folds 5
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SHIFT = 200.0


def get_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/allstate_ftt")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=2048, help="global")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d-token", type=int, default=96)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d, blocks, heads, residual_dropout=0.0, ffn_dropout=0.1):
        super().__init__()
        self.num_w = nn.Parameter(torch.empty(n_num, d))
        self.num_b = nn.Parameter(torch.empty(n_num, d))
        self.cat = nn.Embedding(sum(cards), d)
        self.cat_b = nn.Parameter(torch.empty(len(cards), d))
        for w in (self.num_w, self.num_b, self.cat_b):
            nn.init.uniform_(w, -d ** -0.5, d ** -0.5)
        nn.init.uniform_(self.cat.weight, -d ** -0.5, d ** -0.5)
        self.register_buffer("off", torch.tensor(np.r_[0, np.cumsum(cards)[:-1]], dtype=torch.long))
        self.cls = nn.Parameter(torch.empty(1, 1, d).uniform_(-d ** -0.5, d ** -0.5))
        layer = nn.TransformerEncoderLayer(d, heads, int(d * 4 / 3), ffn_dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.out = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        t_num = x_num[..., None] * self.num_w + self.num_b
        t_cat = self.cat(x_cat + self.off) + self.cat_b
        x = torch.cat([self.cls.expand(len(x_num), -1, -1), t_num, t_cat], 1)
        return self.out(self.blocks(x)[:, 0]).squeeze(-1)


def prepare(data_dir):
    train = pd.read_csv(os.path.join(data_dir, "train.csv"))
    test = pd.read_csv(os.path.join(data_dir, "test.csv"))
    cat_cols = [c for c in train.columns if c.startswith("cat")]
    num_cols = [c for c in train.columns if c.startswith("cont")]
    both = pd.concat([train[cat_cols], test[cat_cols]])
    cards = []
    for c in cat_cols:
        # levels seen only in test (or < 5 times) share the "rare" id 0
        vc = both[c].value_counts()
        levels = sorted(vc[vc >= 5].index)
        lut = {v: i + 1 for i, v in enumerate(levels)}
        train[c] = train[c].map(lut).fillna(0).astype(np.int64)
        test[c] = test[c].map(lut).fillna(0).astype(np.int64)
        cards.append(len(levels) + 1)
    y = np.log(train["loss"].values + SHIFT).astype(np.float32)
    return train, test, cat_cols, num_cols, cards, y


def rank_shard(n, rank, world):
    return np.arange(rank, n, world)


@torch.no_grad()
def predict_all(model, x_num, x_cat, rows, device, bs=8192):
    """Predict `rows` (this rank's shard) and return (rows, preds) from every rank."""
    model.eval()
    out = []
    for s in range(0, len(rows), bs):
        r = rows[s:s + bs]
        out.append(model(torch.from_numpy(x_num[r]).to(device), torch.from_numpy(x_cat[r]).to(device)).float().cpu())
    preds = torch.cat(out).numpy() if out else np.zeros(0, np.float32)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (rows, preds))
    return shards


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train, test, cat_cols, num_cols, cards, y = prepare(args.data)
    x_cat = train[cat_cols].values
    x_cat_te = test[cat_cols].values
    oof = np.zeros(len(train), np.float32)
    pred_te = np.zeros(len(test), np.float32)
    per_gpu = args.batch_size // world
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)

    kf = KFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    for fold, (tr_idx, va_idx) in enumerate(kf.split(train)):
        mu = train.iloc[tr_idx][num_cols].mean()
        sd = train.iloc[tr_idx][num_cols].std()
        x_num = ((train[num_cols] - mu) / sd).values.astype(np.float32)
        x_num_te = ((test[num_cols] - mu) / sd).values.astype(np.float32)
        y_mean = float(y[tr_idx].mean())

        ds = TensorDataset(torch.from_numpy(x_num[tr_idx]), torch.from_numpy(x_cat[tr_idx]),
                           torch.from_numpy(y[tr_idx] - y_mean))
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

        model = DDP(FTTransformer(len(num_cols), cards, args.d_token, args.blocks, args.heads).to(device),
                    device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=5)
        loss_fn = nn.HuberLoss(delta=0.5)

        va_rows = va_idx[rank_shard(len(va_idx), rank, world)]
        best_mae, best_state = np.inf, None
        for epoch in range(args.epochs):
            model.train()
            t0, seen, total = time.time(), 0, 0.0
            for i, (xn, xc, yb) in enumerate(loader):
                xn, xc, yb = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                loss = loss_fn(model(xn, xc), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step(epoch + i / len(loader))
                total += loss.item() * len(yb)
                seen += len(yb)

            pred = np.zeros(len(train), np.float32)
            for rows, p in predict_all(model.module, x_num, x_cat, va_rows, device):
                pred[rows] = p + y_mean
            mae = float(np.mean(np.abs(np.exp(pred[va_idx]) - np.exp(y[va_idx]))))
            if rank == 0:
                print(f"fold {fold} epoch {epoch:02d} huber {total / seen:.4f} val MAE {mae:.2f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
            if mae < best_mae:
                best_mae = mae
                oof[va_idx] = np.exp(pred[va_idx]) - SHIFT
                best_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

        model.module.load_state_dict(best_state)
        rows_te = rank_shard(len(test), rank, world)
        for rows, p in predict_all(model.module, x_num_te, x_cat_te, rows_te, device):
            pred_te[rows] += (np.exp(p + y_mean) - SHIFT) / args.folds
        if rank == 0:
            torch.save(best_state, os.path.join(args.out, f"ftt_fold{fold}.pt"))
            print(f"fold {fold} best MAE {best_mae:.2f}", flush=True)

    if rank == 0:
        cv = np.mean(np.abs(oof - train["loss"].values))
        print(f"CV MAE {cv:.3f}")
        pd.DataFrame({"id": train["id"], "loss": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
        pd.DataFrame({"id": test["id"], "loss": pred_te}).to_csv(os.path.join(args.out, "submission.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
