"""Churn prediction MLP on tabular features, trained data-parallel.

Validation after every epoch; the checkpoint with the lowest validation log-loss
is kept, training stops after --patience epochs without improvement.

    torchrun --nnodes=1 --nproc_per_node=4 03_tabular_churn_mlp.py --train data/churn_train.parquet
"""
import argparse
import logging
import os
import shutil

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

CAT_COLS = ["plan", "region", "payment_method", "device"]
TARGET = "churned"


def parse():
    parser = argparse.ArgumentParser(description="churn MLP")
    parser.add_argument("--train", required=True)
    parser.add_argument("--valid", default=None, help="defaults to <train> with _train -> _valid")
    parser.add_argument("--ckpt-dir", default="ckpt/churn")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 256, 128])
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3, help="for 4 GPUs x 1024 rows")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--patience", type=int, default=6)
    parser.add_argument("--min-delta", type=float, default=1e-4)
    return parser.parse_args()


class ChurnMLP(nn.Module):
    def __init__(self, n_num, cat_cards, hidden, dropout):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, min(16, (c + 1) // 2)) for c in cat_cards])
        d_in = n_num + sum(e.embedding_dim for e in self.embs)
        layers = []
        for h in hidden:
            layers += [nn.Linear(d_in, h), nn.LayerNorm(h), nn.SiLU(), nn.Dropout(dropout)]
            d_in = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d_in, 1)

    def forward(self, x_num, x_cat):
        feats = [x_num] + [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        return self.head(self.body(torch.cat(feats, dim=1))).squeeze(1)


def load_frames(train_path, valid_path):
    train_df = pd.read_parquet(train_path)
    valid_df = pd.read_parquet(valid_path)
    num_cols = [c for c in train_df.columns if c not in CAT_COLS + [TARGET]]
    # category codes from the training frame; sorted so every process gets the same mapping
    cards = []
    for c in CAT_COLS:
        cats = sorted(train_df[c].astype(str).unique())
        mapping = {v: i + 1 for i, v in enumerate(cats)}  # 0 = unseen
        for df in (train_df, valid_df):
            df[c] = df[c].astype(str).map(mapping).fillna(0).astype(np.int64)
        cards.append(len(cats) + 1)
    mu = train_df[num_cols].mean()
    sd = train_df[num_cols].std().replace(0, 1)

    def to_tensors(df):
        x_num = torch.tensor(((df[num_cols] - mu) / sd).fillna(0).values, dtype=torch.float32)
        x_cat = torch.tensor(df[CAT_COLS].values, dtype=torch.long)
        y = torch.tensor(df[TARGET].values, dtype=torch.float32)
        return TensorDataset(x_num, x_cat, y)

    return to_tensors(train_df), to_tensors(valid_df), len(num_cols), cards


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    for x_num, x_cat, y in loader:
        x_num, x_cat, y = x_num.to(device), x_cat.to(device), y.to(device)
        logits = model(x_num, x_cat)
        stats[0] += nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum")
        stats[1] += ((logits > 0).float() == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    valid_path = args.valid or args.train.replace("_train", "_valid")
    train_ds, valid_ds, n_num, cards = load_frames(args.train, valid_path)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    # every row once: strided shard per rank, sums are all-reduced in validate()
    valid_loader = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world_size)), batch_size=4096)

    torch.manual_seed(0)
    model = ChurnMLP(n_num, cards, args.hidden, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best_loss = float("inf")
    epochs_no_improve = 0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = 0.0
        for step, (x_num, x_cat, y) in enumerate(train_loader):
            x_num = x_num.to(device, non_blocking=True)
            x_cat = x_cat.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = nn.functional.binary_cross_entropy_with_logits(model(x_num, x_cat), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
        scheduler.step()

        val_loss, val_acc = validate(model, valid_loader, device)

        if rank == 0:
            log.info("epoch %3d train %.4f | valid logloss %.4f acc %.4f", epoch,
                     running / max(1, len(train_loader)), val_loss, val_acc)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "val_loss": val_loss},
                       os.path.join(args.ckpt_dir, "last.pt"))
            if val_loss < best_loss - args.min_delta:
                best_loss = val_loss
                epochs_no_improve = 0
                shutil.copyfile(os.path.join(args.ckpt_dir, "last.pt"), os.path.join(args.ckpt_dir, "best.pt"))
                log.info("  best so far, copied to best.pt")
            else:
                epochs_no_improve += 1
                if epochs_no_improve >= args.patience:
                    log.info("early stopping after epoch %d (best logloss %.4f)", epoch, best_loss)
                    break

    dist.barrier()
    state = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(state["model"])
    val_loss, val_acc = validate(model, valid_loader, device)
    if rank == 0:
        log.info("best checkpoint (epoch %d): valid logloss %.4f acc %.4f", state["epoch"], val_loss, val_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
