"""Bank customer churn (Playground S4E1): TabTransformer + per-fold target encoding of Surname,
5-fold CV with DDP, resumable at epoch granularity (preemptible queue).

    torchrun --nproc_per_node=4 14_bank_churn_tabtr_resume.py --train data/s4e1/train.csv \
        --out /shared/exp/churn_tabtr [--resume]
"""
import argparse
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

CATS = ["Geography", "Gender", "NumOfProducts", "HasCrCard", "IsActiveMember", "Tenure"]
NUMS = ["CreditScore", "Age", "Balance", "EstimatedSalary"]


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim=32, depth=4, heads=4, drop=0.1):
        super().__init__()
        self.embeds = nn.ModuleList([nn.Embedding(c, dim) for c in cards])
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, drop, activation="gelu", batch_first=True)
        self.transformer = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(n_num)
        d = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Dropout(drop),
                                 nn.Linear(4 * d, 2 * d), nn.ReLU(), nn.Linear(2 * d, 1))

    def forward(self, x_cat, x_num):
        x = torch.stack([e(x_cat[:, i]) for i, e in enumerate(self.embeds)], 1)
        x = self.transformer(x).flatten(1)
        return self.mlp(torch.cat([x, self.norm(x_num)], 1)).squeeze(-1)


def surname_te(tr, va, y_tr, alpha=30.0, seed=0):
    prior = y_tr.mean()
    enc_tr = np.full(len(tr), prior, np.float32)
    for a, b in StratifiedKFold(5, shuffle=True, random_state=seed).split(tr, y_tr):
        s = pd.DataFrame({"k": tr["Surname"].values[a], "y": y_tr[a]}).groupby("k")["y"].agg(["sum", "count"])
        enc_tr[b] = tr["Surname"].iloc[b].map((s["sum"] + alpha * prior) / (s["count"] + alpha)).fillna(prior).values
    s = pd.DataFrame({"k": tr["Surname"].values, "y": y_tr}).groupby("k")["y"].agg(["sum", "count"])
    enc_va = va["Surname"].map((s["sum"] + alpha * prior) / (s["count"] + alpha)).fillna(prior).values
    return enc_tr, enc_va.astype(np.float32)


def fold_tensors(df, y, tr_idx, va_idx, seed):
    tr, va = df.iloc[tr_idx], df.iloc[va_idx]
    te_tr, te_va = surname_te(tr, va, y[tr_idx], seed=seed)
    n_tr = np.column_stack([tr[NUMS].values, te_tr]).astype(np.float32)
    n_va = np.column_stack([va[NUMS].values, te_va]).astype(np.float32)
    mu, sd = n_tr.mean(0), n_tr.std(0) + 1e-6
    mk = lambda frame, n, yy: TensorDataset(torch.from_numpy(frame[CATS].values.astype(np.int64)),
                                            torch.from_numpy((n - mu) / sd), torch.from_numpy(yy))
    return mk(tr, n_tr, y[tr_idx]), mk(va, n_va, y[va_idx])


def save_state(path, **state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=1024, help="global")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.train)
    for c in ["Geography", "Gender"]:
        df[c] = df[c].astype("category").cat.codes
    df["Tenure"] = df["Tenure"].clip(0, 10)
    df["NumOfProducts"] = df["NumOfProducts"].clip(1, 4) - 1
    df["Balance"] = np.log1p(df["Balance"])
    cards = [int(df[c].max()) + 1 for c in CATS]
    y = df["Exited"].values.astype(np.float32)
    folds = list(StratifiedKFold(args.folds, shuffle=True, random_state=args.seed).split(df, y))
    state_path = os.path.join(args.out, "state.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    start_fold, start_epoch, resume = 0, 0, None
    oof = np.zeros(len(df), np.float32)
    if args.resume and os.path.exists(state_path):
        resume = torch.load(state_path)
        start_fold, start_epoch, oof = resume["fold"], resume["epoch"] + 1, resume["oof"].numpy()
        if rank == 0:
            print(f"resuming at fold {start_fold} epoch {start_epoch}", flush=True)

    for fold in range(start_fold, args.folds):
        tr_idx, va_idx = folds[fold]
        tr_ds, va_ds = fold_tensors(df, y, tr_idx, va_idx, args.seed)
        sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(tr_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=2,
                            pin_memory=True, drop_last=True)
        net = TabTransformer(cards, len(NUMS) + 1).to(device)
        model = DDP(net, device_ids=[local_rank])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
        best_auc, first_epoch = 0.0, 0
        if resume is not None and resume["fold"] == fold:
            net.load_state_dict(resume["model"])
            opt.load_state_dict(resume["optimizer"])
            sched.load_state_dict(resume["scheduler"])
            best_auc, first_epoch = resume["best_auc"], start_epoch
            resume = None

        rows = torch.arange(rank, len(va_ds), world)
        va_cat, va_num = va_ds.tensors[0][rows].to(device), va_ds.tensors[1][rows].to(device)
        for epoch in range(first_epoch, args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for xc, xn, yb in loader:
                xc, xn, yb = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                loss = F.binary_cross_entropy_with_logits(model(xc, xn), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()

            net.eval()
            with torch.no_grad():
                p = torch.sigmoid(net(va_cat, va_num)).cpu().numpy()
            parts = [None] * world
            dist.all_gather_object(parts, (rows.numpy(), p))
            pred = np.zeros(len(va_ds), np.float32)
            for r, q in parts:
                pred[r] = q
            auc = roc_auc_score(y[va_idx], pred)
            if auc > best_auc:
                best_auc = auc
                oof[va_idx] = pred
                if rank == 0:
                    torch.save(net.state_dict(), os.path.join(args.out, f"best_fold{fold}.pt"))
            if rank == 0:
                print(f"fold {fold} epoch {epoch:02d} loss {loss.item():.4f} auc {auc:.5f} "
                      f"best {best_auc:.5f} {time.time() - t0:.1f}s", flush=True)
                save_state(state_path, fold=fold, epoch=epoch, model=net.state_dict(), optimizer=opt.state_dict(),
                           scheduler=sched.state_dict(), best_auc=float(best_auc), oof=torch.from_numpy(oof))
            dist.barrier()
        if rank == 0:
            print(f"fold {fold} best auc {best_auc:.5f}", flush=True)

    if rank == 0:
        print(f"OOF AUC {roc_auc_score(y, oof):.5f}")
        pd.DataFrame({"id": df["id"], "Exited": oof}).to_csv(os.path.join(args.out, "oof.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
