#!/usr/bin/env python
"""Cross-silo FedSGD on UCI Adult.

Each rank plays one silo (a group of US states / regions), owns only its own rows,
and the server step is an all-reduce of the silos' gradients weighted by batch size.
Silos keep their data local; only gradients are exchanged.

    torchrun --nproc_per_node=6 04_fedsgd_adult_tabular.py --csv /data/adult/adult_full.csv
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

CATEGORICAL = ["workclass", "education", "marital-status", "occupation",
               "relationship", "race", "sex"]
NUMERIC = ["age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"]
REGIONS = {
    0: ["United-States"],
    1: ["Mexico", "Puerto-Rico", "El-Salvador", "Cuba", "Jamaica", "Dominican-Republic",
        "Guatemala", "Columbia", "Haiti", "Nicaragua", "Peru", "Ecuador", "Honduras",
        "Trinadad&Tobago", "Outlying-US(Guam-USVI-etc)"],
    2: ["Philippines", "India", "China", "Vietnam", "Japan", "Taiwan", "Iran", "Hong",
        "Thailand", "Cambodia", "Laos", "South"],
    3: ["Germany", "England", "Italy", "Poland", "Portugal", "France", "Greece", "Ireland",
        "Yugoslavia", "Hungary", "Scotland", "Holand-Netherlands"],
    4: ["Canada"],
    5: ["?"],
}


def build_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="/data/adult/adult_full.csv")
    ap.add_argument("--logdir", default="runs/fedsgd_adult")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--test-frac", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def encode(df):
    """One-hot categoricals with a fixed vocabulary so every silo gets the same columns."""
    cols = []
    for c in CATEGORICAL:
        vocab = sorted(df[c].astype(str).unique())
        cols.append(pd.get_dummies(pd.Categorical(df[c].astype(str), categories=vocab), prefix=c))
    num = df[NUMERIC].astype(np.float32)
    num = (num - num.mean()) / (num.std() + 1e-6)
    x = pd.concat([num.reset_index(drop=True)] + [c.reset_index(drop=True) for c in cols], axis=1)
    y = (df["income"].astype(str).str.contains(">50K")).astype(np.int64).values
    return x.values.astype(np.float32), y


class MLP(nn.Module):
    def __init__(self, d_in, hidden):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


def allreduce_grads(model, weight, total_weight):
    for p in model.parameters():
        if p.grad is None:
            continue
        p.grad.mul_(weight / total_weight)
        dist.all_reduce(p.grad)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(4, device=device)  # tp, fp, fn, correct
    n = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = (model(x) > 0).long()
        t[0] += ((pred == 1) & (y == 1)).sum()
        t[1] += ((pred == 1) & (y == 0)).sum()
        t[2] += ((pred == 0) & (y == 1)).sum()
        t[3] += (pred == y).sum()
        n += y.numel()
    dist.all_reduce(t)
    dist.all_reduce(n)
    precision = t[0] / (t[0] + t[1]).clamp(min=1)
    recall = t[0] / (t[0] + t[2]).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-8)
    return (t[3] / n).item(), f1.item()


def main():
    args = build_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert world == len(REGIONS), f"one silo per rank: launch with {len(REGIONS)} processes"
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.csv, skipinitialspace=True)
    x_all, y_all = encode(df)  # global vocabulary / normalisation from the shared schema file
    country = df["native-country"].astype(str).values
    silo_mask = np.isin(country, REGIONS[rank])
    idx = np.where(silo_mask)[0]
    rng = np.random.default_rng(args.seed + rank)
    rng.shuffle(idx)
    n_test = int(len(idx) * args.test_frac)
    test_idx, train_idx = idx[:n_test], idx[n_test:]

    train_ds = TensorDataset(torch.from_numpy(x_all[train_idx]), torch.from_numpy(y_all[train_idx]))
    test_ds = TensorDataset(torch.from_numpy(x_all[test_idx]), torch.from_numpy(y_all[test_idx]))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=False)
    test_loader = DataLoader(test_ds, batch_size=1024)
    print(f"[silo {rank}] {len(train_idx)} train / {len(test_idx)} test rows", flush=True)

    model = MLP(x_all.shape[1], args.hidden).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)

    pos_frac = torch.tensor([y_all[train_idx].mean()], device=device)
    dist.all_reduce(pos_frac)
    pos_frac /= world
    pos_weight = (1 - pos_frac) / pos_frac.clamp(min=1e-3)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device).float()
            opt.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()

            bsz = torch.tensor([float(len(y))], device=device)
            total = bsz.clone()
            dist.all_reduce(total)
            allreduce_grads(model, bsz.item(), total.item())
            opt.step()

            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss_silo0", loss.item(), step)

        acc, f1 = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch + 1}: acc={acc:.4f} f1={f1:.4f}", flush=True)
            writer.add_scalar("test/acc", acc, epoch + 1)
            writer.add_scalar("test/f1", f1, epoch + 1)

    if rank == 0:
        torch.save({"model": model.state_dict(), "d_in": x_all.shape[1]},
                   os.path.join(args.logdir, "mlp_fedsgd.pt"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
