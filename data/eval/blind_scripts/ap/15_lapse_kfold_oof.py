"""Life policy lapse model: 5-fold CV with out-of-fold predictions for the stacking layer.

Each fold trains a TabTransformer data-parallel on all GPUs. Writes
  oof_tabtf.csv   (policy_id, fold, oof_pred, lapsed)
  test_tabtf.csv  (policy_id, pred averaged over folds)
  fold{k}.pt      per-fold weights

    torchrun --nproc_per_node=4 15_lapse_kfold_oof.py --train data/lapse/train.csv --test data/lapse/test.csv
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CATS = ["product_code", "payment_freq", "payment_method", "agent_channel", "smoker", "gender", "region"]
NUMS = ["sum_assured", "premium", "policy_age_m", "insured_age", "n_riders", "missed_payments_12m",
        "premium_to_income", "last_contact_days"]
TARGET = "lapsed"


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="data/lapse/train.csv")
    p.add_argument("--test", default="data/lapse/test.csv")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--out", default="oof/tabtf")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim=32, depth=3, heads=4):
        super().__init__()
        self.embeds = nn.ModuleList([nn.Embedding(c, dim) for c in cards])
        self.shared = nn.Parameter(torch.zeros(len(cards), dim // 4))
        self.proj = nn.Linear(dim + dim // 4, dim)
        self.tf = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, heads, dim * 4, 0.1, batch_first=True), depth)
        self.ln_num = nn.LayerNorm(n_num)
        d = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4 * d, 2 * d),
                                 nn.ReLU(), nn.Linear(2 * d, 1))

    def forward(self, xc, xn):
        e = torch.stack([emb(xc[:, i]) for i, emb in enumerate(self.embeds)], 1)
        e = self.proj(torch.cat([e, self.shared.expand(xc.size(0), -1, -1)], -1))
        return self.mlp(torch.cat([self.tf(e).flatten(1), self.ln_num(xn)], 1)).squeeze(-1)


def encode(train, test):
    cards = []
    for c in CATS:
        levels = sorted(train[c].astype(str).unique())
        lut = {v: i + 1 for i, v in enumerate(levels)}
        train[c] = train[c].astype(str).map(lut).astype(np.int64)
        test[c] = test[c].astype(str).map(lut).fillna(0).astype(np.int64)
        cards.append(len(levels) + 1)
    for c in NUMS:
        mu, sd = train[c].mean(), train[c].std() + 1e-9
        train[c] = ((train[c] - mu) / sd).fillna(0)
        test[c] = ((test[c] - mu) / sd).fillna(0)
    return cards


def make_ds(frame, with_y=True):
    y = frame[TARGET].values if with_y else np.zeros(len(frame))
    return TensorDataset(torch.tensor(frame[CATS].values), torch.tensor(frame[NUMS].values, dtype=torch.float32),
                         torch.tensor(y, dtype=torch.float32))


@torch.no_grad()
def predict(net, loader, device):
    net.eval()
    return np.concatenate([torch.sigmoid(net(xc.to(device), xn.to(device))).cpu().numpy() for xc, xn, _ in loader])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = pd.read_csv(args.train)
    test = pd.read_csv(args.test)
    cards = encode(train, test)
    y = train[TARGET].values
    test_loader = DataLoader(make_ds(test, with_y=False), batch_size=8192)

    oof = np.zeros(len(train))
    test_pred = np.zeros(len(test))
    fold_of = np.full(len(train), -1)
    splitter = StratifiedGroupKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for fold, (tr_idx, va_idx) in enumerate(splitter.split(train, y, groups=train["customer_id"])):
        torch.manual_seed(args.seed + fold)
        tr_ds, va_ds = make_ds(train.iloc[tr_idx]), make_ds(train.iloc[va_idx])
        tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed + fold, drop_last=True)
        va_sampler = DistributedSampler(va_ds, shuffle=False)
        tr_loader = DataLoader(tr_ds, batch_size=args.batch_size, sampler=tr_sampler, num_workers=4, pin_memory=True)
        va_loader = DataLoader(va_ds, batch_size=4096, sampler=va_sampler)

        model = DDP(TabTransformer(cards, len(NUMS), args.dim, args.depth).to(device), device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world, epochs=args.epochs,
                                                    steps_per_epoch=len(tr_loader))
        crit = nn.BCEWithLogitsLoss()
        for epoch in range(args.epochs):
            tr_sampler.set_epoch(epoch)
            model.train()
            for xc, xn, yb in tr_loader:
                loss = crit(model(xc.to(device), xn.to(device)), yb.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()

        shard = np.array(list(iter(va_sampler)))
        p_va = predict(model, va_loader, device)
        rows = va_idx[shard]
        oof[rows] = p_va
        fold_of[rows] = fold
        fold_auc = roc_auc_score(y[rows], p_va)

        if rank == 0:
            test_pred += predict(model.module, test_loader, device) / args.folds
            torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.pt"))
            print(f"fold {fold}: train {len(tr_idx)} valid {len(va_idx)}  AUC {fold_auc:.4f}", flush=True)
        dist.barrier()

    if rank == 0:
        print(f"OOF AUC {roc_auc_score(y, oof):.4f}")
        pd.DataFrame({"policy_id": train["policy_id"], "fold": fold_of, "oof_pred": oof, TARGET: y}).to_csv(
            os.path.join(args.out, "oof_tabtf.csv"), index=False)
        pd.DataFrame({"policy_id": test["policy_id"], "pred": test_pred}).to_csv(
            os.path.join(args.out, "test_tabtf.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
