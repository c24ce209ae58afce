"""Loan default prediction (Lending-Club style table), Ray Train + plain torch loop.

    python 16_tabular_loan_ray_train.py --csv /mnt/data/loans.csv --workers 4
"""
import argparse
import os
import tempfile

import numpy as np
import pandas as pd
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

NUMERIC = ["loan_amnt", "int_rate", "installment", "annual_inc", "dti", "delinq_2yrs", "fico_range_low",
           "inq_last_6mths", "open_acc", "pub_rec", "revol_bal", "revol_util", "total_acc", "emp_length_num"]
CATEGORICAL = ["term", "grade", "sub_grade", "home_ownership", "verification_status", "purpose", "addr_state"]


def preprocess(csv):
    df = pd.read_csv(csv, low_memory=False)
    df = df[df["loan_status"].isin(["Fully Paid", "Charged Off"])]
    df["target"] = (df["loan_status"] == "Charged Off").astype(np.float32)
    df["emp_length_num"] = df["emp_length"].str.extract(r"(\d+)").astype(float)
    df["int_rate"] = df["int_rate"].astype(str).str.rstrip("%").astype(float)
    df["revol_util"] = df["revol_util"].astype(str).str.rstrip("%").replace("nan", np.nan).astype(float)
    for c in NUMERIC:
        df[c] = df[c].fillna(df[c].median())
    df[["annual_inc", "revol_bal", "loan_amnt"]] = np.log1p(df[["annual_inc", "revol_bal", "loan_amnt"]])
    cards = []
    for c in CATEGORICAL:
        df[c] = df[c].fillna("NA").astype("category").cat.codes.astype(np.int64) + 1
        cards.append(int(df[c].max()) + 1)
    tr, va = train_test_split(df, test_size=0.15, random_state=7, stratify=df["target"])
    mu, sd = tr[NUMERIC].mean(), tr[NUMERIC].std() + 1e-6
    pack = lambda d: (((d[NUMERIC] - mu) / sd).values.astype(np.float32), d[CATEGORICAL].values,
                      d["target"].values.astype(np.float32))
    return pack(tr), pack(va), cards


class LoanNet(nn.Module):
    def __init__(self, n_num, cards, emb=8, hidden=256, p=0.15):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb) for c in cards])
        d = n_num + emb * len(cards)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(p),
                                 nn.Linear(hidden, hidden // 2), nn.BatchNorm1d(hidden // 2), nn.ReLU(),
                                 nn.Dropout(p), nn.Linear(hidden // 2, 1))

    def forward(self, xn, xc):
        e = torch.cat([m(xc[:, i]) for i, m in enumerate(self.embs)], 1)
        return self.mlp(torch.cat([xn, e], 1)).squeeze(1)


def train_func(config):
    (xn_tr, xc_tr, y_tr), (xn_va, xc_va, y_va) = config["train"], config["val"]
    train_ds = TensorDataset(torch.from_numpy(xn_tr), torch.from_numpy(xc_tr), torch.from_numpy(y_tr))
    val_ds = TensorDataset(torch.from_numpy(xn_va), torch.from_numpy(xc_va), torch.from_numpy(y_va))
    train_loader = DataLoader(train_ds, batch_size=config["bs"], shuffle=True, drop_last=True, num_workers=2)
    val_loader = DataLoader(val_ds, batch_size=4096, shuffle=False)
    train_loader = ray.train.torch.prepare_data_loader(train_loader)
    val_loader = ray.train.torch.prepare_data_loader(val_loader)

    model = ray.train.torch.prepare_model(LoanNet(xn_tr.shape[1], config["cards"]))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=1e-4)
    pos_weight = torch.tensor((1 - y_tr.mean()) / y_tr.mean(), device=ray.train.torch.get_device())
    world = ray.train.get_context().get_world_size()

    for epoch in range(config["epochs"]):
        if world > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        for xn, xc, y in train_loader:
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y, pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()

        model.eval()
        loss_sum, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for xn, xc, y in val_loader:
                logits = model(xn, xc)
                loss_sum += F.binary_cross_entropy_with_logits(logits, y, reduction="sum").item()
                correct += ((logits > 0).float() == y).sum().item()
                n += y.numel()
        stats = torch.tensor([loss_sum, correct, n], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        val_loss, val_acc = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if ray.train.get_context().get_world_rank() == 0:
                net = model.module if hasattr(model, "module") else model
                torch.save(net.state_dict(), os.path.join(tmp, "model.pt"))
                ckpt = Checkpoint.from_directory(tmp)
            ray.train.report({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc}, checkpoint=ckpt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/loans.csv")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    ray.init()
    train, val, cards = preprocess(args.csv)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"train": train, "val": val, "cards": cards, "epochs": args.epochs,
                           "bs": args.bs, "lr": args.lr},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=True),
        run_config=RunConfig(name="loan_default"),
    )
    result = trainer.fit()
    print(result.metrics)


if __name__ == "__main__":
    main()
