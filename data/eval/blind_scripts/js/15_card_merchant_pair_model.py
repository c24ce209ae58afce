"""Card x merchant pair model: learns which (card, merchant) combinations are normal and
flags improbable pairs, combined with per-transaction context features.

Input comes from the Spark job `export_pairs`, which writes one parquet part per trainer
rank (part-00000 ... part-{world-1}); merchant_idx / mcc_idx are global dictionary ids.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=trainer-0:29400 \
        15_card_merchant_pair_model.py --data-root /mnt/lake/pairs/2024-06
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
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

CARD_BUCKETS = 2 ** 20
CTX_COLS = ["amt_log", "amt_ratio_card_median", "hour_sin", "hour_cos", "is_ecom", "is_foreign",
            "days_since_first_seen_pair", "n_pair_90d", "card_txn_24h", "merchant_fraud_rate_30d"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--out", default="/mnt/lake/models/pair_model")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--emb-lr", type=float, default=5e-3)
    ap.add_argument("--pos-weight", type=float, default=30.0)
    return ap.parse_args()


def load_part(root, split, rank):
    df = pd.read_parquet(os.path.join(root, split, f"part-{rank:05d}.parquet"))
    ctx = torch.tensor(df[CTX_COLS].fillna(0).to_numpy(np.float32))
    card = torch.tensor((df["card_hash"].to_numpy(np.int64) % CARD_BUCKETS))
    merchant = torch.tensor(df["merchant_idx"].to_numpy(np.int64))
    mcc = torch.tensor(df["mcc_idx"].to_numpy(np.int64))
    y = torch.tensor(df["is_fraud"].to_numpy(np.float32))
    return df, TensorDataset(card, merchant, mcc, ctx, y)


class PairModel(nn.Module):
    def __init__(self, n_merchants, n_mcc, dim, n_ctx):
        super().__init__()
        self.card = nn.Embedding(CARD_BUCKETS, dim)
        self.merchant = nn.Embedding(n_merchants, dim)
        self.mcc = nn.Embedding(n_mcc, dim)
        self.ctx = nn.Sequential(nn.Linear(n_ctx, 128), nn.ReLU(), nn.Linear(128, dim))
        self.out = nn.Sequential(nn.Linear(4 * dim + 1, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 1))
        for e in (self.card, self.merchant, self.mcc):
            nn.init.normal_(e.weight, std=0.01)

    def forward(self, card, merchant, mcc, ctx):
        c, m, k = self.card(card), self.merchant(merchant), self.mcc(mcc)
        affinity = (c * (m + k)).sum(-1, keepdim=True)
        h = torch.cat([c, m, k, self.ctx(ctx), affinity], dim=-1)
        return self.out(h).squeeze(-1)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_df, train_ds = load_part(args.data_root, "train", rank)
    val_df, val_ds = load_part(args.data_root, "val", rank)
    n_merchants = int(max(train_df["merchant_idx"].max(), val_df["merchant_idx"].max())) + 1
    n_mcc = 1000

    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=2,
                        pin_memory=True)
    steps = torch.tensor(len(loader), device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    steps = int(steps)

    model = PairModel(n_merchants, n_mcc, args.dim, len(CTX_COLS)).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    emb_params = [p for n, p in model.named_parameters() if n.split(".")[1] in ("card", "merchant", "mcc")]
    dense_params = [p for n, p in model.named_parameters() if n.split(".")[1] not in ("card", "merchant", "mcc")]
    opt = torch.optim.Adam([{"params": dense_params, "lr": args.lr},
                            {"params": emb_params, "lr": args.emb_lr}])
    pos_weight = torch.tensor(args.pos_weight, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} rows/rank={len(train_ds)} steps/epoch={steps} merchants={n_merchants}", flush=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        it = iter(loader)
        acc = torch.zeros(2, device=device)
        for step in range(steps):
            card, merchant, mcc, ctx, y = (t.to(device, non_blocking=True) for t in next(it))
            loss = F.binary_cross_entropy_with_logits(model(card, merchant, mcc, ctx), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 500 == 0:
                print(f"  epoch {epoch} step {step}/{steps} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(acc)

        model.eval()
        with torch.no_grad():
            card, merchant, mcc, ctx, y = val_ds.tensors
            scores = []
            for i in range(0, len(y), 65536):
                sl = slice(i, i + 65536)
                scores.append(torch.sigmoid(model.module(card[sl].to(device), merchant[sl].to(device),
                                                         mcc[sl].to(device), ctx[sl].to(device))).cpu())
            local = (torch.cat(scores).numpy(), y.numpy())
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            s = np.concatenate([p[0] for p in parts])
            t = np.concatenate([p[1] for p in parts])
            print(f"epoch {epoch} train_loss {(acc[0] / acc[1]).item():.4f} val_pr_auc "
                  f"{average_precision_score(t, s):.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "n_merchants": n_merchants, "epoch": epoch},
                       os.path.join(args.out, f"pair_model_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
