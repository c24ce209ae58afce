"""Home Credit default risk - FT-Transformer on application_train + bureau aggregates.

Distributed data parallel, 5-fold CV, OOF + test predictions.

    torchrun --nproc_per_node=8 18_home_credit_ftt_ddp.py --data-dir /data/home-credit --out runs/hc_ftt
"""
import argparse
import gc
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
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("home_credit")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", default="runs/hc_ftt")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=512, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--d-token", type=int, default=96)
    parser.add_argument("--n-blocks", type=int, default=2)
    parser.add_argument("--max-card", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1001)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d=96, n_blocks=2, heads=8, attn_drop=0.2, ffn_drop=0.1):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n_num, d).normal_(std=d ** -0.5))
        self.b = nn.Parameter(torch.zeros(n_num, d))
        self.emb = nn.Embedding(sum(cards), d)
        self.register_buffer("offset", torch.tensor(np.r_[0, np.cumsum(cards)[:-1]], dtype=torch.long))
        self.cls = nn.Parameter(torch.empty(1, 1, d).normal_(std=d ** -0.5))
        layer = nn.TransformerEncoderLayer(d, heads, int(4 * d / 3), ffn_drop, activation="gelu",
                                           batch_first=True, norm_first=True)
        layer.self_attn.dropout = attn_drop
        self.blocks = nn.TransformerEncoder(layer, n_blocks, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x_num, x_cat):
        x = torch.cat([self.cls.expand(x_num.shape[0], -1, -1),
                       x_num[:, :, None] * self.w + self.b,
                       self.emb(x_cat + self.offset)], dim=1)
        return self.head(self.blocks(x)[:, 0]).squeeze(-1)


def build_features(data_dir, max_card):
    app = pd.read_csv(os.path.join(data_dir, "application_train.csv"))
    test = pd.read_csv(os.path.join(data_dir, "application_test.csv"))
    bureau = pd.read_csv(os.path.join(data_dir, "bureau.csv"))
    agg = bureau.groupby("SK_ID_CURR").agg(
        bureau_n=("SK_ID_BUREAU", "count"), bureau_active=("CREDIT_ACTIVE", lambda s: (s == "Active").sum()),
        bureau_debt=("AMT_CREDIT_SUM_DEBT", "sum"), bureau_overdue=("AMT_CREDIT_SUM_OVERDUE", "sum"),
        bureau_days_credit_mean=("DAYS_CREDIT", "mean"))
    app, test = app.merge(agg, on="SK_ID_CURR", how="left"), test.merge(agg, on="SK_ID_CURR", how="left")
    app["DAYS_EMPLOYED"] = app["DAYS_EMPLOYED"].replace(365243, np.nan)
    test["DAYS_EMPLOYED"] = test["DAYS_EMPLOYED"].replace(365243, np.nan)
    for df in (app, test):
        df["CREDIT_INCOME"] = df["AMT_CREDIT"] / df["AMT_INCOME_TOTAL"]
        df["ANNUITY_INCOME"] = df["AMT_ANNUITY"] / df["AMT_INCOME_TOTAL"]
        df["CREDIT_TERM"] = df["AMT_ANNUITY"] / df["AMT_CREDIT"]
    cat_cols = [c for c in app.columns if app[c].dtype == object]
    num_cols = [c for c in app.columns if c not in cat_cols + ["SK_ID_CURR", "TARGET"]]
    cards = []
    for c in cat_cols:
        vc = app[c].value_counts()
        keep = sorted(vc.index[:max_card - 1])
        lut = {v: i + 1 for i, v in enumerate(keep)}
        app[c] = app[c].map(lut).fillna(0).astype(np.int64)
        test[c] = test[c].map(lut).fillna(0).astype(np.int64)
        cards.append(len(keep) + 1)
    return app, test, cat_cols, num_cols, cards


def robust_scale(tr, *others):
    med = np.nanmedian(tr, 0)
    q25, q75 = np.nanpercentile(tr, 25, 0), np.nanpercentile(tr, 75, 0)
    scale = np.where(q75 - q25 > 0, q75 - q25, 1.0)
    f = lambda a: np.clip(np.nan_to_num((a - med) / scale), -10, 10).astype(np.float32)
    return [f(tr)] + [f(o) for o in others]


@torch.no_grad()
def shard_predict(model, x_num, x_cat, device, bs=8192):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = np.arange(rank, len(x_num), world)
    model.eval()
    preds = []
    for s in range(0, len(rows), bs):
        r = rows[s:s + bs]
        preds.append(torch.sigmoid(model(torch.from_numpy(x_num[r]).to(device),
                                         torch.from_numpy(x_cat[r]).to(device))).cpu())
    gathered = [None] * world
    dist.all_gather_object(gathered, (rows, torch.cat(preds).numpy()))
    out = np.zeros(len(x_num), np.float32)
    for r, p in gathered:
        out[r] = p
    return out


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(args.seed)

    app, test, cat_cols, num_cols, cards = build_features(args.data_dir, args.max_card)
    y = app["TARGET"].values.astype(np.float32)
    x_cat, x_cat_te = app[cat_cols].values, test[cat_cols].values
    oof, sub = np.zeros(len(app), np.float32), np.zeros(len(test), np.float32)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    for fold, (tr_idx, va_idx) in enumerate(skf.split(app, y)):
        x_tr, x_va, x_te = robust_scale(app[num_cols].values[tr_idx].astype(np.float64),
                                        app[num_cols].values[va_idx].astype(np.float64),
                                        test[num_cols].values.astype(np.float64))
        ds = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(x_cat[tr_idx]), torch.from_numpy(y[tr_idx]))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

        model = FTTransformer(len(num_cols), cards, args.d_token, args.n_blocks).to(device)
        model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
        lr = args.lr * world * args.batch_size / 512
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader),
                                                    pct_start=0.1, anneal_strategy="cos")

        best, best_state = 0.0, None
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for xn, xc, yb in loader:
                xn, xc, yb = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                loss = F.binary_cross_entropy_with_logits(model(xn, xc), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            pred = shard_predict(model.module, x_va, x_cat[va_idx], device)
            auc = roc_auc_score(y[va_idx], pred)
            logger.info("fold %d epoch %d loss %.4f val_auc %.5f %.0fs", fold, epoch, loss.item(), auc, time.time() - t0)
            if auc > best:
                best, oof[va_idx] = auc, pred
                best_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}

        model.module.load_state_dict(best_state)
        sub += shard_predict(model.module, x_te, x_cat_te, device) / args.folds
        if rank == 0:
            torch.save(best_state, os.path.join(args.out, f"ftt_fold{fold}.pt"))
        logger.info("fold %d best auc %.5f", fold, best)
        del model, opt, best_state
        gc.collect()
        torch.cuda.empty_cache()

    if rank == 0:
        logger.info("OOF AUC %.5f", roc_auc_score(y, oof))
        pd.DataFrame({"SK_ID_CURR": app["SK_ID_CURR"], "oof": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
        pd.DataFrame({"SK_ID_CURR": test["SK_ID_CURR"], "TARGET": sub}).to_csv(os.path.join(args.out, "submission.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
