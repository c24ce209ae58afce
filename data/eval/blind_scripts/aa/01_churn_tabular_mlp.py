"""Customer churn classifier (tabular MLP with categorical embeddings).

Launch:
    torchrun --nproc_per_node=4 01_churn_tabular_mlp.py --data data/churn.csv --out runs/churn
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import LabelEncoder, StandardScaler
from sklearn.utils.class_weight import compute_class_weight
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("churn")
device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

CAT_COLS = ["gender", "contract", "payment_method", "internet_service", "region"]
NUM_COLS = ["tenure", "monthly_charges", "total_charges", "num_tickets", "age"]
TARGET = "churn"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/churn")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=512, help="per-GPU batch size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--emb-dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--num-workers", type=int, default=4)
    return p.parse_args()


def load_frame(path):
    df = pd.read_csv(path)
    df["total_charges"] = pd.to_numeric(df["total_charges"], errors="coerce")
    df[NUM_COLS] = df[NUM_COLS].fillna(df[NUM_COLS].median())
    df[CAT_COLS] = df[CAT_COLS].fillna("missing").astype(str)
    df[TARGET] = (df[TARGET].astype(str).str.lower().isin(["yes", "1", "true"])).astype(int)
    return df


def encode(df_train, df_val, df_test):
    encoders, cards = {}, []
    for col in CAT_COLS:
        le = LabelEncoder()
        # fit on the train split; unseen values in val/test map to an extra "unknown" index
        le.fit(df_train[col])
        encoders[col] = le
        known = set(le.classes_)
        unk = len(le.classes_)
        for frame in (df_train, df_val, df_test):
            frame[col] = [le.transform([v])[0] if v in known else unk for v in frame[col]]
        cards.append(unk + 1)
    scaler = StandardScaler().fit(df_train[NUM_COLS])
    for frame in (df_train, df_val, df_test):
        frame[NUM_COLS] = scaler.transform(frame[NUM_COLS])
    return encoders, scaler, cards


class TabularDataset(Dataset):
    def __init__(self, df):
        self.cat = torch.as_tensor(df[CAT_COLS].values, dtype=torch.long)
        self.num = torch.as_tensor(df[NUM_COLS].values, dtype=torch.float32)
        self.y = torch.as_tensor(df[TARGET].values, dtype=torch.long)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.y[i]


class ChurnMLP(nn.Module):
    def __init__(self, cards, n_num, emb_dim, hidden, dropout):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_dim) for c in cards])
        in_dim = emb_dim * len(cards) + n_num
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden // 2), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden // 2, 2),
        )

    def forward(self, cat, num):
        x = torch.cat([emb(cat[:, i]) for i, emb in enumerate(self.embs)] + [num], dim=1)
        return self.net(x)


def make_criterion(y_train):
    w = compute_class_weight("balanced", classes=np.array([0, 1]), y=y_train)
    return nn.CrossEntropyLoss(weight=torch.tensor(w, dtype=torch.float32, device=device))


@torch.no_grad()
def evaluate(model, loader, criterion, dev):
    model.eval()
    stats = torch.zeros(4, device=dev)  # loss_sum, correct, n, tp
    pos = torch.zeros(2, device=dev)  # predicted positives, actual positives
    for cat, num, y in loader:
        cat, num, y = cat.to(dev, non_blocking=True), num.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        logits = model(cat, num)
        loss = criterion(logits, y)
        pred = logits.argmax(1)
        stats[0] += loss.item() * y.numel()
        stats[1] += (pred == y).sum()
        stats[2] += y.numel()
        stats[3] += ((pred == 1) & (y == 1)).sum()
        pos[0] += (pred == 1).sum()
        pos[1] += (y == 1).sum()
    dist.all_reduce(stats)
    dist.all_reduce(pos)
    precision = (stats[3] / pos[0].clamp(min=1)).item()
    recall = (stats[3] / pos[1].clamp(min=1)).item()
    f1 = 2 * precision * recall / max(precision + recall, 1e-8)
    return {"loss": (stats[0] / stats[2]).item(), "acc": (stats[1] / stats[2]).item(), "f1": f1}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    df = load_frame(args.data)
    df_train, df_tmp = train_test_split(df, test_size=0.3, stratify=df[TARGET], random_state=args.seed)
    df_val, df_test = train_test_split(df_tmp, test_size=0.5, stratify=df_tmp[TARGET], random_state=args.seed)
    df_train, df_val, df_test = df_train.copy(), df_val.copy(), df_test.copy()
    _, _, cards = encode(df_train, df_val, df_test)
    logger.info("train=%d val=%d test=%d cards=%s", len(df_train), len(df_val), len(df_test), cards)

    train_ds, val_ds, test_ds = TabularDataset(df_train), TabularDataset(df_val), TabularDataset(df_test)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=2048,
                            sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)
    test_loader = DataLoader(test_ds, batch_size=2048,
                             sampler=DistributedSampler(test_ds, shuffle=False), num_workers=2)

    model = ChurnMLP(cards, len(NUM_COLS), args.emb_dim, args.hidden, args.dropout).to(dev)
    model = DDP(model, device_ids=[local_rank])
    criterion = make_criterion(df_train[TARGET].values)
    lr = args.lr * world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)

    os.makedirs(args.out, exist_ok=True)
    best_f1, bad_epochs = -1.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for step, (cat, num, y) in enumerate(train_loader):
            cat, num, y = cat.to(dev, non_blocking=True), num.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(cat, num), y)
            loss.backward()
            optimizer.step()
            running += loss.item()
        val = evaluate(model, val_loader, criterion, dev)
        scheduler.step(val["f1"])
        logger.info("epoch %d train_loss %.4f val %s (%.1fs)", epoch, running / max(1, len(train_loader)),
                    json.dumps({k: round(v, 4) for k, v in val.items()}), time.time() - t0)

        if val["f1"] > best_f1:
            best_f1, bad_epochs = val["f1"], 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "cards": cards, "epoch": epoch, "val": val},
                           os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        if bad_epochs >= args.patience:
            logger.info("early stopping at epoch %d", epoch)
            break

    dist.barrier()
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=dev)
    model.module.load_state_dict(ckpt["model"])
    test = evaluate(model, test_loader, criterion, dev)
    if rank == 0:
        logger.info("test %s", test)
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"best_val_f1": best_f1, "test": test}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
