# Adult income (census) classifier - MLP with categorical embeddings.
# Multi-GPU with torch.multiprocessing.spawn, one process per GPU.
#
#   python 04_adult_income_mlp_spawn.py --csv data/adult.csv --epochs 25
#
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["workclass", "education", "marital-status", "occupation",
            "relationship", "race", "sex", "native-country"]
NUM_COLS = ["age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"]
TARGET = "income"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/adult.csv")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch_size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emb_dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--port", default="29512")
    p.add_argument("--save_path", default="adult_mlp_best.pt")
    return p.parse_args()


def load_tabular(csv_path):
    df = pd.read_csv(csv_path, skipinitialspace=True).replace("?", np.nan).dropna()
    y = (df[TARGET].str.strip().str.rstrip(".") == ">50K").astype(np.float32).values

    cardinalities = []
    cat = np.zeros((len(df), len(CAT_COLS)), dtype=np.int64)
    for i, c in enumerate(CAT_COLS):
        codes, uniques = pd.factorize(df[c])
        cat[:, i] = codes
        cardinalities.append(len(uniques))

    num = df[NUM_COLS].values.astype(np.float32)
    idx_tr, idx_va = train_test_split(np.arange(len(df)), test_size=0.2, random_state=0, stratify=y)
    scaler = StandardScaler().fit(num[idx_tr])
    num = scaler.transform(num).astype(np.float32)

    def tds(idx):
        return TensorDataset(torch.from_numpy(cat[idx]), torch.from_numpy(num[idx]), torch.from_numpy(y[idx]))

    return tds(idx_tr), tds(idx_va), cardinalities


class TabularMLP(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim=8, hidden=256, dropout=0.2):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(n, emb_dim) for n in cardinalities])
        in_dim = emb_dim * len(cardinalities) + n_num
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden // 2), nn.BatchNorm1d(hidden // 2), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden // 2, 1),
        )

    def forward(self, x_cat, x_num):
        e = [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        x = torch.cat(e + [x_num], dim=1)
        return self.net(x).squeeze(1)


def train_worker(rank, world_size, args, train_ds, val_ds, cardinalities):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    val_loader = DataLoader(val_ds, batch_size=4096, shuffle=False)

    model = TabularMLP(cardinalities, len(NUM_COLS), args.emb_dim, args.hidden, args.dropout).to(device)
    model = DDP(model, device_ids=[rank])

    pos_weight = torch.tensor([3.0], device=device)  # ~24% positives
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)

    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(2, device=device)
        for x_cat, x_num, y in train_loader:
            x_cat, x_num, y = x_cat.to(device), x_num.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x_cat, x_num), y)
            loss.backward()
            optimizer.step()
            stats[0] += loss.item() * y.size(0)
            stats[1] += y.size(0)
        dist.all_reduce(stats)
        train_loss = (stats[0] / stats[1]).item()

        # validation set is small, every rank scores all of it so the AUC is identical everywhere
        model.eval()
        probs, targets = [], []
        with torch.no_grad():
            for x_cat, x_num, y in val_loader:
                out = model.module(x_cat.to(device), x_num.to(device))
                probs.append(torch.sigmoid(out).cpu())
                targets.append(y)
        probs = torch.cat(probs).numpy()
        targets = torch.cat(targets).numpy()
        auc = roc_auc_score(targets, probs)
        acc = ((probs > 0.5) == targets).mean()
        scheduler.step(auc)

        if rank == 0:
            print(f"Epoch {epoch + 1:02d} | loss {train_loss:.4f} | val auc {auc:.4f} | val acc {acc:.4f}")
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.module.state_dict(), "cardinalities": cardinalities,
                            "auc": auc, "epoch": epoch}, args.save_path)
                print("   -> saved best model")

    if rank == 0:
        print(f"Best validation AUC: {best_auc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


args = parse_args()
train_ds, val_ds, cardinalities = load_tabular(args.csv)
world_size = torch.cuda.device_count()
print(f"Found {world_size} GPUs, {len(train_ds)} train rows, {len(val_ds)} val rows")
mp.spawn(train_worker, args=(world_size, args, train_ds, val_ds, cardinalities), nprocs=world_size, join=True)
