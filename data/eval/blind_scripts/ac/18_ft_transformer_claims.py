"""FT-Transformer for claim-fraud scoring on the tabular claims extract.

Kubeflow PyTorchJob with elasticPolicy/nprocPerNode: "4", Master x1 + Worker x1.
The operator exports PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun picks up by itself:

    command: ["torchrun", "/workspace/train_ft.py",
              "--table", "/data/claims/claims_2021_2024.parquet",
              "--out", "/models/ft-fraud"]
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
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, random_split
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["provider_type", "state", "procedure_group", "place_of_service", "plan", "channel"]
NUM_COLS = ["billed", "allowed", "units", "days_to_submit", "patient_age", "prior_claims_90d",
            "provider_claims_30d", "distance_km"]
TARGET = "is_fraud"


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--table", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--d", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--bs", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def encode_table(df, vocab_path):
    """Integer-codes categoricals with a vocabulary fixed once and stored next to the data."""
    with open(vocab_path) as fh:
        vocab = json.load(fh)
    cats = np.stack([df[c].astype(str).map({v: i + 1 for i, v in enumerate(vocab[c])}).fillna(0).astype(np.int64)
                     for c in CAT_COLS], axis=1)
    num = df[NUM_COLS].astype(np.float32)
    num = np.sign(num) * np.log1p(np.abs(num))
    num = ((num - num.mean()) / (num.std() + 1e-6)).fillna(0.0).to_numpy(np.float32)
    y = df[TARGET].astype(np.float32).to_numpy()
    cards = [len(vocab[c]) + 1 for c in CAT_COLS]
    return torch.from_numpy(cats), torch.from_numpy(num), torch.from_numpy(y), cards


class FTTransformer(nn.Module):
    def __init__(self, cards, n_num, d, layers, heads=8):
        super().__init__()
        self.cat_emb = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.num_w = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, int(d * 4 / 3), dropout=0.1,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, cat, num):
        toks = [emb(cat[:, i]) for i, emb in enumerate(self.cat_emb)]
        toks = torch.stack(toks, 1)
        nt = num.unsqueeze(-1) * self.num_w + self.num_b
        x = torch.cat([self.cls.expand(cat.size(0), -1, -1), toks, nt], 1)
        x = self.enc(x)
        return self.out(self.norm(x[:, 0])).squeeze(-1)


@torch.no_grad()
def score(model, loader, device, world):
    model.eval()
    ps, ys = [], []
    for cat, num, y in loader:
        ps.append(torch.sigmoid(model(cat.to(device), num.to(device))).float())
        ys.append(y.to(device))
    p, y = torch.cat(ps), torch.cat(ys)
    n = torch.tensor([p.numel()], device=device)
    ns = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(ns, n)
    m = int(max(int(v) for v in ns))
    pp = [torch.zeros(m, device=device) for _ in range(world)]
    yy = [torch.zeros(m, device=device) for _ in range(world)]
    dist.all_gather(pp, F.pad(p, (0, m - p.numel())))
    dist.all_gather(yy, F.pad(y, (0, m - y.numel())))
    P = torch.cat([a[: int(k)] for a, k in zip(pp, ns)]).cpu().numpy()
    Y = torch.cat([a[: int(k)] for a, k in zip(yy, ns)]).cpu().numpy()
    model.train()
    return roc_auc_score(Y, P), average_precision_score(Y, P)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout masks per rank
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    df = pd.read_parquet(args.table)
    cats, nums, ys, cards = encode_table(df, os.path.join(os.path.dirname(args.table), "vocab.json"))
    full = TensorDataset(cats, nums, ys)
    n_val = int(len(full) * args.val_frac)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val])

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True,
                          drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=4096, num_workers=2)

    model = FTTransformer(cards, len(NUM_COLS), args.d, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    pos_weight = torch.tensor([(1 - ys.mean()) / ys.mean()], device=device).clamp(max=50.0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.bs / 4096, weight_decay=1e-5)

    os.makedirs(args.out, exist_ok=True)
    best_ap = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for cat, num, y in train_dl:
            cat, num, y = cat.to(device), num.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(cat, num), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        auc, ap = score(model.module, val_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} val_auc {auc:.4f} val_ap {ap:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": model.module.state_dict(), "cards": cards, "epoch": epoch,
                            "val_ap": ap}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
