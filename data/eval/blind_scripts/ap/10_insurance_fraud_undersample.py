"""Insurance claim fraud: FT-Transformer with per-epoch negative undersampling.

Fraud is ~0.6% of claims. Each epoch every GPU draws all frauds from its part of the
claims plus neg_ratio x as many genuine claims, which keeps the batches balanced while
still cycling through the negatives over the epochs.

    torchrun --nproc_per_node=4 10_insurance_fraud_undersample.py --claims data/claims_2019_2024.parquet
"""
import argparse
import logging
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CATS = ["policy_type", "incident_type", "collision_type", "incident_severity", "authorities_contacted",
        "incident_state", "vehicle_make", "insured_occupation", "repair_shop_id"]
NUMS = ["claim_amount", "policy_annual_premium", "policy_deductible", "months_as_customer",
        "age", "witnesses", "bodily_injuries", "days_policy_to_incident", "prior_claims_3y"]
LABEL = "fraud_reported"

log = logging.getLogger("fraud")


class FTTransformer(nn.Module):
    def __init__(self, cards, n_num, d=64, depth=3, heads=8, drop=0.1):
        super().__init__()
        self.cat_tok = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.num_w = nn.Parameter(torch.randn(n_num, d) / d ** 0.5)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cls = nn.Parameter(torch.randn(1, 1, d) / d ** 0.5)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, drop, activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, xc, xn):
        toks = [self.cls.expand(xc.size(0), -1, -1),
                torch.stack([emb(xc[:, i]) for i, emb in enumerate(self.cat_tok)], 1),
                xn.unsqueeze(-1) * self.num_w + self.num_b]
        return self.head(self.enc(torch.cat(toks, 1))[:, 0]).squeeze(-1)


def encode(df, maps, mean, std):
    xc = np.stack([df[c].astype(str).map(maps[c]).fillna(0).astype(np.int64).values for c in CATS], 1)
    xn = np.nan_to_num(((df[NUMS].values - mean) / std).astype(np.float32))
    return xc, xn, df[LABEL].values.astype(np.float32)


def epoch_subsample(xc, xn, y, neg_ratio, seed):
    rng = np.random.default_rng(seed)
    pos = np.flatnonzero(y == 1)
    neg = np.flatnonzero(y == 0)
    neg = rng.choice(neg, size=min(len(neg), neg_ratio * len(pos)), replace=False)
    keep = rng.permutation(np.concatenate([pos, neg]))
    return TensorDataset(torch.from_numpy(xc[keep]), torch.from_numpy(xn[keep]), torch.from_numpy(y[keep]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--claims", required=True)
    ap.add_argument("--valid-from", default="2024-01-01")
    ap.add_argument("--neg-ratio", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=1024, help="global batch")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default="models/claims_fraud_ftt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    claims = pd.read_parquet(args.claims)
    claims[LABEL] = (claims[LABEL].astype(str).str.upper().isin(["Y", "1", "TRUE"])).astype(int)
    train = claims[claims["incident_date"] < args.valid_from].reset_index(drop=True)
    valid = claims[claims["incident_date"] >= args.valid_from].reset_index(drop=True)
    maps = {c: {v: i + 1 for i, v in enumerate(sorted(train[c].astype(str).unique()))} for c in CATS}
    mean, std = train[NUMS].mean().values, train[NUMS].std().values + 1e-6

    # each rank keeps a disjoint slice of the training claims
    xc_tr, xn_tr, y_tr = encode(train.iloc[rank::world], maps, mean, std)
    xc_va, xn_va, y_va = encode(valid, maps, mean, std)
    valid_ds = TensorDataset(torch.arange(len(y_va)), torch.from_numpy(xc_va), torch.from_numpy(xn_va), torch.from_numpy(y_va))
    valid_loader = DataLoader(valid_ds, batch_size=4096, sampler=DistributedSampler(valid_ds, shuffle=False))
    log.info("train claims %d (%d fraud), valid %d (%d fraud)", len(train), int(train[LABEL].sum()),
             len(valid), int(y_va.sum()))

    model = FTTransformer([len(maps[c]) + 1 for c in CATS], len(NUMS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)

    os.makedirs(args.out, exist_ok=True)
    best_ap, bad = 0.0, 0
    for epoch in range(args.epochs):
        t0 = time.time()
        ds = epoch_subsample(xc_tr, xn_tr, y_tr, args.neg_ratio, seed=args.seed * 1000 + epoch)
        loader = DataLoader(ds, batch_size=args.batch_size // world, shuffle=True, num_workers=2, pin_memory=True)
        model.train()
        tot = torch.zeros(2, device=device)
        for xc, xn, y in loader:
            xc, xn, y = xc.to(device), xn.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(xc, xn), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tot)

        model.eval()
        rows = []
        with torch.no_grad():
            for idx, xc, xn, _ in valid_loader:
                rows.append(np.stack([idx.numpy(), torch.sigmoid(model(xc.to(device), xn.to(device))).cpu().numpy()], 1))
        parts = [None] * world
        dist.all_gather_object(parts, np.concatenate(rows))
        merged = np.concatenate(parts)
        _, first = np.unique(merged[:, 0].astype(np.int64), return_index=True)
        prob = merged[first, 1]

        stop = torch.zeros(1, device=device)
        if rank == 0:
            ap_score, auc = average_precision_score(y_va, prob), roc_auc_score(y_va, prob)
            log.info("epoch %02d loss %.4f | valid AP %.4f AUC %.4f | %.0fs", epoch, (tot[0] / tot[1]).item(),
                     ap_score, auc, time.time() - t0)
            if ap_score > best_ap:
                best_ap, bad = ap_score, 0
                torch.save({"model": model.module.state_dict(), "maps": maps, "mean": mean, "std": std},
                           os.path.join(args.out, "best.pt"))
            else:
                bad += 1
            stop[0] = bad >= args.patience
        dist.broadcast(stop, 0)
        if stop.item():
            log.info("no AP improvement for %d epochs, stopping", args.patience)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
