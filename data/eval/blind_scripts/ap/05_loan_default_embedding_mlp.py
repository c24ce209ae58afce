"""Loan default (PD) model: entity embeddings + MLP, data parallel over GPUs.

    torchrun --nproc_per_node=8 05_loan_default_embedding_mlp.py --data data/lending/loans_2015_2022.csv
"""
import argparse
import os
import random
import time

import joblib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import brier_score_loss, roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CATS = ["grade", "sub_grade", "home_ownership", "purpose", "addr_state", "emp_length", "verification_status", "term"]
NUMS = ["loan_amnt", "int_rate", "installment", "annual_inc", "dti", "revol_util", "revol_bal",
        "open_acc", "total_acc", "delinq_2yrs", "inq_last_6mths", "fico_range_low", "mort_acc"]
TARGET = "default"


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output", default="models/pd_mlp")
    p.add_argument("--valid-size", type=float, default=0.15)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--emb-dim-max", type=int, default=24)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class EmbMLP(nn.Module):
    def __init__(self, cards, n_num, emb_max=24, hidden=(512, 256, 64), p=0.25):
        super().__init__()
        dims = [min(emb_max, (c + 1) // 2 + 1) for c in cards]
        self.embs = nn.ModuleList([nn.Embedding(c + 1, d) for c, d in zip(cards, dims)])
        self.emb_drop = nn.Dropout(0.1)
        layers, d_in = [], sum(dims) + n_num
        for h in hidden:
            layers += [nn.Linear(d_in, h), nn.LayerNorm(h), nn.ReLU(), nn.Dropout(p)]
            d_in = h
        self.mlp = nn.Sequential(*layers, nn.Linear(d_in, 1))

    def forward(self, xc, xn):
        e = torch.cat([emb(xc[:, i]) for i, emb in enumerate(self.embs)], 1)
        return self.mlp(torch.cat([self.emb_drop(e), xn], 1)).squeeze(1)


def encode_frame(df, vocab, scaler):
    xc = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).values.astype(np.int64) for c in CATS], 1)
    xn = scaler.transform(df[NUMS].fillna(df[NUMS].median()).values).astype(np.float32)
    return torch.from_numpy(xc), torch.from_numpy(xn), torch.from_numpy(df[TARGET].values.astype(np.float32))


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    out = []
    for idx, xc, xn, y in loader:
        prob = torch.sigmoid(model(xc.to(device), xn.to(device)))
        out.append(torch.stack([idx.to(device).float(), prob, y.to(device)], 1))
    out = torch.cat(out)
    gathered = [torch.zeros_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)  # same length on every rank thanks to DistributedSampler padding
    out = torch.cat(gathered).cpu().numpy()
    _, first = np.unique(out[:, 0], return_index=True)
    return out[first, 1], out[first, 2]


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed + rank)

    df = pd.read_csv(args.data, low_memory=False)
    df = df[df["loan_status"].isin(["Fully Paid", "Charged Off", "Default"])].copy()
    df[TARGET] = (df["loan_status"] != "Fully Paid").astype(int)
    df["int_rate"] = df["int_rate"].astype(str).str.rstrip("%").astype(float)
    df["revol_util"] = df["revol_util"].astype(str).str.rstrip("%").replace("nan", np.nan).astype(float)

    train_df, valid_df = train_test_split(df, test_size=args.valid_size, stratify=df[TARGET])
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(df[c].astype(str).unique()))} for c in CATS}
    scaler = StandardScaler().fit(train_df[NUMS].fillna(train_df[NUMS].median()).values)

    xc, xn, y = encode_frame(train_df, vocab, scaler)
    train_ds = TensorDataset(torch.arange(len(y)), xc, xn, y)
    xc, xn, y = encode_frame(valid_df, vocab, scaler)
    valid_ds = TensorDataset(torch.arange(len(y)), xc, xn, y)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=4096, num_workers=2,
                              sampler=DistributedSampler(valid_ds, num_replicas=world, rank=rank, shuffle=False))

    model = EmbMLP([len(vocab[c]) for c in CATS], len(NUMS), args.emb_dim_max).to(device)
    model = DDP(model, device_ids=[local_rank])
    # linear scaling for the larger global batch, with a short warmup
    lr = args.lr * world
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warmup = len(train_loader)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, total) / total)))
    crit = nn.BCEWithLogitsLoss()

    best_auc = 0.0
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for _, xc_b, xn_b, y_b in train_loader:
            xc_b, xn_b, y_b = xc_b.to(device), xn_b.to(device), y_b.to(device)
            loss = crit(model(xc_b, xn_b), y_b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach() * len(y_b), torch.tensor(float(len(y_b)), device=device)])
        dist.all_reduce(agg)

        prob, y_true = predict(model, valid_loader, device)
        if rank == 0:
            auc = roc_auc_score(y_true, prob)
            gini = 2 * auc - 1
            print(f"[{epoch + 1}/{args.epochs}] loss={agg[0].item() / agg[1].item():.4f} "
                  f"auc={auc:.4f} gini={gini:.4f} brier={brier_score_loss(y_true, prob):.4f} "
                  f"({time.time() - t0:.1f}s)", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.output, "pd_mlp.pt"))
                joblib.dump({"vocab": vocab, "scaler": scaler, "cats": CATS, "nums": NUMS},
                            os.path.join(args.output, "preprocess.joblib"))
        dist.barrier()

    if rank == 0:
        print(f"best valid AUC {best_auc:.4f} (gini {2 * best_auc - 1:.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
