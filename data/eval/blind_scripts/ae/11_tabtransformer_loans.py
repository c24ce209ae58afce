"""TabTransformer on a file-sharded tabular dataset (loan default prediction).

The upstream Spark job writes parquet part files with categorical columns already
integer-encoded (0 = unknown) and numeric columns raw. Each rank reads its own
subset of part files.

    torchrun --nproc_per_node=8 11_tabtransformer_loans.py --train-glob "/data/loans/train/part-*.parquet" \
        --valid-glob "/data/loans/valid/part-*.parquet"
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

CAT = ["grade", "sub_grade", "emp_length", "home_ownership", "purpose", "addr_state",
       "verification_status", "initial_list_status", "application_type", "zip3"]
NUM = ["loan_amnt", "int_rate", "installment", "annual_inc", "dti", "revol_bal",
       "revol_util", "total_acc", "open_acc", "fico_low", "fico_high", "mort_acc"]
TARGET = "default"


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--train-glob", required=True)
    p.add_argument("--valid-glob", required=True)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ckpt-dir", default="ckpt/tabtransformer")
    return p.parse_args()


def read_shard(pattern, rank, world):
    files = sorted(glob.glob(pattern))
    mine = files[rank::world]
    return pd.concat([pd.read_parquet(f, columns=CAT + NUM + [TARGET]) for f in mine],
                     ignore_index=True)


def to_tensors(df, num_mean, num_std):
    x_cat = torch.from_numpy(df[CAT].values.astype(np.int64))
    x_num = torch.from_numpy(((df[NUM].fillna(num_mean).values - num_mean) / num_std).astype(np.float32))
    y = torch.from_numpy(df[TARGET].values.astype(np.float32))
    return TensorDataset(x_cat, x_num, y)


class TabTransformer(nn.Module):
    def __init__(self, cardinalities, n_num, dim, depth, heads):
        super().__init__()
        self.embeds = nn.ModuleList(nn.Embedding(c, dim) for c in cardinalities)
        self.col_emb = nn.Parameter(torch.randn(len(cardinalities), dim) * 0.02)
        enc = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, batch_first=True,
                                         activation="gelu")
        self.transformer = nn.TransformerEncoder(enc, depth)
        self.num_norm = nn.LayerNorm(n_num)
        d_in = dim * len(cardinalities) + n_num
        self.mlp = nn.Sequential(nn.Linear(d_in, d_in), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(d_in, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x_cat, x_num):
        tok = torch.stack([e(x_cat[:, i]) for i, e in enumerate(self.embeds)], 1) + self.col_emb
        ctx = self.transformer(tok).flatten(1)
        return self.mlp(torch.cat([ctx, self.num_norm(x_num)], 1)).squeeze(-1)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_df = read_shard(args.train_glob, rank, world)
    valid_df = read_shard(args.valid_glob, rank, world)

    # global numeric statistics from the per-rank sums
    num = torch.tensor(train_df[NUM].values, dtype=torch.float64, device=device)
    valid_mask = ~torch.isnan(num)
    num0 = torch.nan_to_num(num)
    s = torch.stack([num0.sum(0), (num0 ** 2).sum(0), valid_mask.sum(0).double()])
    dist.all_reduce(s)
    mean = (s[0] / s[2]).cpu().numpy()
    std = np.sqrt(np.maximum((s[1] / s[2]).cpu().numpy() - mean ** 2, 1e-12))

    cardinalities = [int(train_df[c].max()) + 1 for c in CAT]

    train_ds = to_tensors(train_df, mean, std)
    valid_ds = to_tensors(valid_df, mean, std)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=2, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=4096, shuffle=False, num_workers=2)

    # shards differ in size; every rank runs the same number of optimizer steps
    n_steps = torch.tensor(len(train_loader), device=device)
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    n_steps = int(n_steps)

    model = TabTransformer(cardinalities, len(NUM), args.dim, args.depth, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    pos = torch.tensor([float(train_df[TARGET].sum()), float(len(train_df))], device=device)
    dist.all_reduce(pos)
    pos_rate = (pos[0] / pos[1]).item()
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos_rate) / pos_rate, device=device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * n_steps)
    auroc = BinaryAUROC().to(device)   # torchmetrics syncs across ranks in compute()

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{world} ranks, {n_steps} steps/epoch, cardinalities {cardinalities}", flush=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        it = iter(train_loader)
        tl = torch.zeros((), device=device)
        for step in range(n_steps):
            x_cat, x_num, y = (t.to(device, non_blocking=True) for t in next(it))
            loss = crit(model(x_cat, x_num), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tl += loss.detach()
        dist.all_reduce(tl)
        tl = tl.item() / (n_steps * world)

        model.eval()
        auroc.reset()
        with torch.no_grad():
            for x_cat, x_num, y in valid_loader:
                logits = model(x_cat.to(device), x_num.to(device))
                auroc.update(torch.sigmoid(logits), y.to(device).long())
        auc = auroc.compute().item()
        if rank == 0:
            print(f"epoch {epoch} loss {tl:.4f} val_auc {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                torch.save({"model": model.module.state_dict(), "cardinalities": cardinalities,
                            "num_mean": mean, "num_std": std, "epoch": epoch},
                           os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
