"""
Customer churn prediction - tabular MLP with categorical embeddings.

Started as a Kaggle notebook, moved to a script so it can run on the 4-GPU box:

    torchrun --nproc_per_node=4 01_churn_tabular_mlp.py --data data/churn.csv

The dataset is small (~1M rows) and is read completely on every rank; the
DistributedSampler splits the rows.
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
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["state", "area_code", "plan", "contract_type", "payment_method", "gender"]
NUM_COLS = ["tenure", "monthly_charges", "total_charges", "day_minutes", "eve_minutes",
            "night_minutes", "intl_minutes", "service_calls"]
TARGET = "churn"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/churn.csv")
    p.add_argument("--out", default="runs/churn_mlp")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch_size", type=int, default=1024, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="lr for one GPU, scaled by world size")
    p.add_argument("--emb_dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class ChurnDataset(Dataset):
    def __init__(self, cats, nums, y):
        self.cats = torch.as_tensor(cats, dtype=torch.long)
        self.nums = torch.as_tensor(nums, dtype=torch.float32)
        self.y = torch.as_tensor(y, dtype=torch.long)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.cats[i], self.nums[i], self.y[i]


class ChurnMLP(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim=8, hidden=256, dropout=0.2):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb_dim) for c in cardinalities])
        in_dim = emb_dim * len(cardinalities) + n_num
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden // 2), nn.LayerNorm(hidden // 2), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden // 2, 2),
        )

    def forward(self, cats, nums):
        e = [emb(cats[:, i]) for i, emb in enumerate(self.embs)]
        return self.net(torch.cat(e + [nums], dim=1))


def load_frame(path, seed):
    df = pd.read_csv(path)
    df["total_charges"] = pd.to_numeric(df["total_charges"], errors="coerce").fillna(0.0)
    for c in CAT_COLS:
        df[c] = df[c].astype("category").cat.codes + 1  # 0 kept for unknown
    num = df[NUM_COLS].values.astype(np.float32)
    num = (num - num.mean(0)) / (num.std(0) + 1e-6)
    df[NUM_COLS] = num
    tr, va = train_test_split(df, test_size=0.15, random_state=seed, stratify=df[TARGET])
    return tr, va


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, labels = [], []
    for cats, nums, y in loader:
        logits = model(cats.to(device), nums.to(device))
        probs.append(torch.softmax(logits, 1)[:, 1].cpu())
        labels.append(y)
    probs = torch.cat(probs).numpy()
    labels = torch.cat(labels).numpy()
    return roc_auc_score(labels, probs), ((probs > 0.5) == labels).mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    tr, va = load_frame(args.data, args.seed)
    cardinalities = [int(max(tr[c].max(), va[c].max())) + 1 for c in CAT_COLS]
    train_ds = ChurnDataset(tr[CAT_COLS].values, tr[NUM_COLS].values, tr[TARGET].values)
    val_ds = ChurnDataset(va[CAT_COLS].values, va[NUM_COLS].values, va[TARGET].values)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4096, shuffle=False, num_workers=2)

    model = ChurnMLP(cardinalities, len(NUM_COLS), args.emb_dim, args.hidden, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    # churners are ~14% of the rows, weight the positive class
    pos_frac = tr[TARGET].mean()
    class_weights = torch.tensor([1.0, (1 - pos_frac) / pos_frac], dtype=torch.float32).to("cuda:0")
    criterion = nn.CrossEntropyLoss(weight=class_weights)

    lr = args.lr * world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, epochs=args.epochs, steps_per_epoch=len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train rows {len(train_ds)}  val rows {len(val_ds)}  world size {world_size}")

    best_auc = 0.0
    history = []
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for cats, nums, y in train_loader:
            cats, nums, y = cats.to(device, non_blocking=True), nums.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(cats, nums)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach() * y.size(0)
            running[1] += y.size(0)

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        if rank == 0:
            auc, acc = evaluate(model.module, val_loader, device)
            history.append({"epoch": epoch, "loss": train_loss, "auc": auc, "acc": acc})
            print(f"epoch {epoch:02d} loss {train_loss:.4f} val_auc {auc:.4f} val_acc {acc:.4f} "
                  f"({time.time() - t0:.1f}s)")
            if auc > best_auc:
                best_auc = auc
                torch.save({"model": model.module.state_dict(), "cardinalities": cardinalities,
                            "epoch": epoch, "auc": auc}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print(f"best val auc {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
