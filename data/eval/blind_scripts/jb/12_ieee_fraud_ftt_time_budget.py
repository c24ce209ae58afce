"""IEEE-CIS fraud detection: FT-Transformer on the transaction table, time-based folds.

The full run has to fit in the cluster's 8h slot, so every fold gets a wall-clock budget;
when a fold's budget is spent it stops and moves on with the best weights so far.

    torchrun --nproc_per_node=8 12_ieee_fraud_ftt_time_budget.py --data /mnt/datasets/ieee-fraud \
        --fold-budget-min 80
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CATS = ["ProductCD", "card1", "card2", "card3", "card4", "card5", "card6", "addr1", "addr2",
        "P_emaildomain", "R_emaildomain", "M4", "M5", "M6"]
logger = logging.getLogger("ieee")


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/mnt/shared/runs/ieee_ftt")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=1024, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="at 8 GPUs x 1024")
    ap.add_argument("--fold-budget-min", type=float, default=80.0)
    ap.add_argument("--eval-every", type=int, default=1)
    ap.add_argument("--min-count", type=int, default=10)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


class FTT(nn.Module):
    def __init__(self, n_num, cards, d=64, depth=3, heads=8, p=0.1):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_num, d) * d ** -0.5)
        self.b = nn.Parameter(torch.zeros(n_num, d))
        self.nan_emb = nn.Parameter(torch.zeros(n_num, d))   # learned token for missing numerics
        self.emb = nn.Embedding(sum(cards), d)
        self.register_buffer("off", torch.tensor(np.r_[0, np.cumsum(cards)[:-1]], dtype=torch.long))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, p, activation="gelu", batch_first=True, norm_first=True)
        self.tr = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        miss = torch.isnan(x_num).unsqueeze(-1)
        num = torch.where(miss, self.nan_emb.expand(x_num.size(0), -1, -1),
                          torch.nan_to_num(x_num).unsqueeze(-1) * self.w + self.b)
        x = torch.cat([self.cls.expand(x_num.size(0), -1, -1), num, self.emb(x_cat + self.off)], 1)
        return self.head(self.tr(x)[:, 0]).squeeze(-1)


def load(data_dir, min_count):
    df = pd.read_parquet(os.path.join(data_dir, "train_transaction.parquet"))
    df["month"] = (df["TransactionDT"] // (30 * 24 * 3600)).astype(int)
    num_cols = [c for c in df.columns if c.startswith(("C", "D", "V")) and df[c].dtype != object]
    num_cols = ["TransactionAmt"] + num_cols[:120]
    df["TransactionAmt"] = np.log1p(df["TransactionAmt"])
    cards = []
    for c in CATS:
        vc = df[c].astype(str).value_counts()
        keep = sorted(vc[vc >= min_count].index)
        lut = {v: i + 1 for i, v in enumerate(keep)}
        df[c] = df[c].astype(str).map(lut).fillna(0).astype(np.int64)
        cards.append(len(keep) + 1)
    return df, num_cols, cards


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    ids, ps = [], []
    for i, xn, xc, _ in loader:
        ps.append(torch.sigmoid(model(xn.to(device), xc.to(device))).cpu())
        ids.append(i)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (torch.cat(ids).numpy(), torch.cat(ps).numpy()))
    out = np.zeros(n, np.float32)
    for i, p in gathered:
        out[i] = p
    return out


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    df, num_cols, cards = load(args.data, args.min_count)
    y = df["isFraud"].values.astype(np.float32)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    oof = np.zeros(len(df), np.float32)
    budget = args.fold_budget_min * 60
    for fold, (tr_idx, va_idx) in enumerate(GroupKFold(n_splits=6).split(df, y, groups=df["month"])):
        tr = df.iloc[tr_idx]
        q1, q99 = tr[num_cols].quantile(0.01), tr[num_cols].quantile(0.99)
        med, iqr = tr[num_cols].median(), (q99 - q1).replace(0, 1.0)
        x_num = torch.tensor(((df[num_cols].clip(q1, q99, axis=1) - med) / iqr).values, dtype=torch.float32)
        x_cat = torch.tensor(df[CATS].values, dtype=torch.long)
        idx = torch.arange(len(df))
        tr_ds = TensorDataset(idx[tr_idx], x_num[tr_idx], x_cat[tr_idx], torch.from_numpy(y[tr_idx]))
        va_ds = TensorDataset(torch.arange(len(va_idx)), x_num[va_idx], x_cat[va_idx], torch.from_numpy(y[va_idx]))
        sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed, drop_last=True)
        tr_dl = DataLoader(tr_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
        va_dl = DataLoader(va_ds, batch_size=8192, sampler=DistributedSampler(va_ds, shuffle=False), num_workers=2)

        model = DDP(FTT(len(num_cols), cards).to(dev), device_ids=[local_rank])
        lr = args.lr * (args.batch_size * world) / (8 * 1024)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
        pos = float(y[tr_idx].mean())
        crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(min(20.0, (1 - pos) / pos), device=dev))

        best_auc, t_start, out_of_time = 0.0, time.time(), False
        ckpt = os.path.join(args.out, f"fold{fold}.pt")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for step, (_, xn, xc, yb) in enumerate(tr_dl):
                if time.time() - t_start > budget:
                    out_of_time = True
                    break
                xn, xc, yb = xn.to(dev, non_blocking=True), xc.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
                loss = crit(model(xn, xc), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

            if epoch % args.eval_every == 0 or out_of_time:
                pred = evaluate(model.module, va_dl, len(va_ds), dev)
                auc = roc_auc_score(y[va_idx], pred)
                logger.info("fold %d epoch %d step %d auc %.5f elapsed %.1f min", fold, epoch, step, auc,
                            (time.time() - t_start) / 60)
                if auc > best_auc:
                    best_auc = auc
                    oof[va_idx] = pred
                    if rank == 0:
                        torch.save(model.module.state_dict(), ckpt)
            if out_of_time:
                logger.info("fold %d: time budget reached after epoch %d", fold, epoch)
                break

        logger.info("fold %d best auc %.5f", fold, best_auc)
        dist.barrier()

    if rank == 0:
        logger.info("OOF AUC %.5f", roc_auc_score(y, oof))
        pd.DataFrame({"TransactionID": df["TransactionID"], "oof": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
