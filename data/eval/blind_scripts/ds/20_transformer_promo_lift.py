"""Transformer forecaster for promotion weeks: baseline demand and promo lift.

Validation reports WAPE plus percentiles of per-series absolute percentage
error (median / p90), which need all series' errors in one place, so the
per-series errors are gathered from all ranks.

    torchrun --nproc_per_node=8 20_transformer_promo_lift.py --data /data/promo_weekly.parquet
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/promo_weekly.parquet")
    p.add_argument("--out", default="runs/promo_lift")
    p.add_argument("--ctx", type=int, default=52)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--val_weeks", type=int, default=16)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=5)
    return p.parse_args()


def load(path):
    df = pd.read_parquet(path)
    idx = "sku_store"
    y = df.pivot_table(index=idx, columns="week", values="units", aggfunc="sum").fillna(0.0)
    disc = df.pivot_table(index=idx, columns="week", values="discount_pct").reindex(y.index).fillna(0.0)
    feat = df.pivot_table(index=idx, columns="week", values="featured").reindex(y.index).fillna(0.0)
    return y.to_numpy(np.float32), np.stack([disc.to_numpy(np.float32), feat.to_numpy(np.float32)], -1)


class PromoWindows(Dataset):
    def __init__(self, y, promo, scale, ctx, h, end):
        self.y, self.promo, self.scale, self.ctx, self.h = y, promo, scale, ctx, h
        self.ix = [(s, t) for s in range(len(y)) for t in range(0, end - ctx - h + 1)]

    def __len__(self):
        return len(self.ix)

    def __getitem__(self, i):
        s, t = self.ix[i]
        w = self.y[s, t:t + self.ctx + self.h] / self.scale[s]
        return torch.from_numpy(w[:self.ctx]), torch.from_numpy(self.promo[s, t:t + self.ctx + self.h]), \
            torch.from_numpy(w[self.ctx:])


class LiftTransformer(nn.Module):
    """Encodes history with promo covariates; decodes baseline and multiplicative lift."""

    def __init__(self, ctx, h, d, layers):
        super().__init__()
        self.ctx, self.h = ctx, h
        self.inp = nn.Linear(3, d)
        self.pos = nn.Parameter(torch.randn(1, ctx + h, d) * 0.02)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), layers)
        self.baseline = nn.Linear(d, 1)
        self.lift = nn.Sequential(nn.Linear(d + 2, d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, hist, promo):
        B = hist.size(0)
        y_in = torch.cat([hist, hist.new_zeros(B, self.h)], 1)
        known = torch.cat([hist.new_ones(B, self.ctx), hist.new_zeros(B, self.h)], 1)
        h = self.enc(self.inp(torch.stack([y_in, known, promo[..., 0]], -1)) + self.pos)
        fut = h[:, self.ctx:]
        base = F.softplus(self.baseline(fut)).squeeze(-1)
        lift = 1 + F.softplus(self.lift(torch.cat([fut, promo[:, self.ctx:]], -1))).squeeze(-1)
        return base * lift


@torch.no_grad()
def validate(net, y, promo, scale, args, rank, world, device):
    net.eval()
    T = y.shape[1]
    rows = np.arange(rank, len(y), world)
    err_sum = np.zeros(len(rows))
    act_sum = np.zeros(len(rows))
    for cut in range(T - args.val_weeks, T - args.horizon + 1, args.horizon):
        hist = torch.from_numpy(y[rows, cut - args.ctx:cut] / scale[rows, None]).to(device)
        pr = torch.from_numpy(promo[rows, cut - args.ctx:cut + args.horizon]).to(device)
        pred = net(hist, pr).cpu().numpy() * scale[rows, None]
        true = y[rows, cut:cut + args.horizon]
        err_sum += np.abs(pred - true).sum(1)
        act_sum += true.sum(1)
    local = torch.from_numpy(np.stack([err_sum, act_sum], 1)).to(device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered).cpu().numpy()
    net.train()
    err, act = allv[:, 0], allv[:, 1]
    ape = err[act > 0] / act[act > 0]
    return {"wape": float(err.sum() / max(act.sum(), 1e-8)),
            "ape_median": float(np.median(ape)), "ape_p90": float(np.percentile(ape, 90))}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(8)

    y, promo = load(args.data)
    T = y.shape[1]
    train_end = T - args.val_weeks
    scale = np.maximum(y[:, :train_end].mean(1), 1.0).astype(np.float32)
    ds = PromoWindows(y, promo, scale, args.ctx, args.horizon, train_end)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DDP(LiftTransformer(args.ctx, args.horizon, args.d_model, args.layers).to(device),
                device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, waited = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for hist, pr, tgt in loader:
            hist, pr, tgt = hist.to(device), pr.to(device), tgt.to(device)
            # Poisson deviance on scaled units suits the intermittent promo series
            loss = F.poisson_nll_loss(model(hist, pr).clamp_min(1e-6), tgt, log_input=False)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        m = validate(model.module, y, promo, scale, args, rank, world, device)
        if rank == 0:
            print(json.dumps({"epoch": epoch, **m, "sec": round(time.time() - t0)}), flush=True)
        if m["wape"] < best:
            best, waited = m["wape"], 0
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                           os.path.join(args.out, "best.pt"))
        else:
            waited += 1
        dist.barrier()
        if waited >= args.patience:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
