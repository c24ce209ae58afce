"""Shared MLP trunk with one head per sales region (weekly demand, log1p units).

Encoded features are cached as .npy next to the raw parquet so sweeps start fast.

torchrun --standalone --nproc_per_node=4 07_mlp_region_heads_demand.py \
    --data /data/demand/weekly.parquet --cache /data/demand/cache --run-name trunk512_heads
"""
import argparse
import json
import os
import time
from datetime import timedelta

import mlflow
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CATS = ["sku", "store", "brand", "category", "promo_type"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--val-weeks", type=int, default=8)
    ap.add_argument("--emb-dim", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default="runs/demand")
    return ap.parse_args()


def build_cache(args):
    df = pd.read_parquet(args.data)
    last = df["week"].max()
    is_val = (df["week"] > last - args.val_weeks).values
    tr = df[~is_val]
    meta = {"cards": {}, "regions": sorted(df["region"].astype(str).unique().tolist())}
    xc = np.empty((len(df), len(CATS)), dtype=np.int64)
    for j, c in enumerate(CATS):
        cats = pd.Index(sorted(tr[c].astype(str).unique()))
        xc[:, j] = cats.get_indexer(df[c].astype(str)) + 1
        meta["cards"][c] = len(cats) + 1
    region = pd.Index(meta["regions"]).get_indexer(df["region"].astype(str))
    num_cols = [c for c in df.columns if c not in CATS + ["region", "week", "units"]]
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=500, random_state=0)
    qt.fit(tr[num_cols].fillna(0).values)
    xn = qt.transform(df[num_cols].fillna(0).values).astype(np.float32)
    y = np.log1p(df["units"].clip(lower=0).values).astype(np.float32)
    meta["num_cols"] = num_cols

    tmp = args.cache + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    for name, arr in dict(xn=xn, xc=xc, region=region, y=y, is_val=is_val).items():
        np.save(os.path.join(tmp, name + ".npy"), arr)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    os.rename(tmp, args.cache)


def load_cache(path):
    arrs = {k: np.load(os.path.join(path, k + ".npy")) for k in ("xn", "xc", "region", "y", "is_val")}
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    return arrs, meta


class RegionHeadsMLP(nn.Module):
    def __init__(self, n_num, cards, n_regions, emb_dim, hidden):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(k, emb_dim) for k in cards)
        d = n_num + emb_dim * len(cards)
        self.trunk = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.1),
                                   nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.1))
        self.heads = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(n_regions))

    def forward(self, xn, xc, region):
        h = self.trunk(torch.cat([xn] + [e(xc[:, j]) for j, e in enumerate(self.embs)], 1))
        out = h.new_zeros(h.size(0))
        # only the heads of regions present in this batch run
        for r in torch.unique(region).tolist():
            m = region == r
            out[m] = self.heads[r](h[m]).squeeze(-1)
        return out


@torch.no_grad()
def val_rmse(model, ds, rank, world, device):
    model.eval()
    xn, xc, reg, y = ds.tensors
    shard = np.array_split(np.arange(len(y)), world)[rank]
    sse = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(shard), 16384):
        j = torch.from_numpy(shard[i:i + 16384])
        p = model(xn[j].to(device), xc[j].to(device), reg[j].to(device))
        sse[0] += ((p - y[j].to(device)) ** 2).sum().double()
        sse[1] += len(j)
    dist.all_reduce(sse)
    return (sse[0] / sse[1]).sqrt().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run of a new table spends a while in build_cache while the other ranks wait
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0 and not os.path.isdir(args.cache):
        print("building feature cache ...", flush=True)
        build_cache(args)
    dist.barrier()
    arrs, meta = load_cache(args.cache)
    tr, va = ~arrs["is_val"], arrs["is_val"]
    mk = lambda m: TensorDataset(*(torch.from_numpy(arrs[k][m]) for k in ("xn", "xc", "region", "y")))
    train_ds, val_ds = mk(tr), mk(va)

    model = RegionHeadsMLP(len(meta["num_cols"]), [meta["cards"][c] for c in CATS], len(meta["regions"]),
                           args.emb_dim, args.hidden).to(device)
    # small regions are often absent from a per-GPU batch, so their heads get no gradient that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        mlflow.set_experiment("demand-tabular")
        mlflow.start_run(run_name=args.run_name)
        mlflow.log_params(vars(args))

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for xn, xc, reg, y in loader:
            xn, xc, reg, y = (t.to(device, non_blocking=True) for t in (xn, xc, reg, y))
            loss = F.mse_loss(model(xn, xc, reg), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(acc)
        rmse = val_rmse(model.module, val_ds, rank, world, device)

        if rank == 0:
            train_rmse = (acc[0] / acc[1]).sqrt().item()
            mlflow.log_metrics({"train_rmse": train_rmse, "val_rmse": rmse}, step=epoch)
            print(f"epoch {epoch} train {train_rmse:.4f} val {rmse:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if rmse < best:
                best = rmse
                torch.save({"model": model.module.state_dict(), "meta": meta}, os.path.join(args.out, "best.pt"))

    if rank == 0:
        mlflow.log_metric("best_val_rmse", best)
        mlflow.log_artifact(os.path.join(args.out, "best.pt"))
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
