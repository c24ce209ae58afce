#!/usr/bin/env python3
"""Daily incremental training of the ads CTR model (DCN).

Run by the scheduler once a day after the day's samples land:
    torchrun --nproc_per_node=8 20_daily_incremental_dcn.py --date 2024-10-08

It warm-starts from the previous day's checkpoint (if one exists), trains one pass over the
new day, evaluates on the first hours of the next day and publishes the checkpoint.
"""
import argparse
import json
import logging
import os
import time
from datetime import date, timedelta

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("daily_dcn")
N_DENSE, N_SPARSE = 10, 30


class DaySamples(Dataset):
    def __init__(self, path, buckets, max_rows=None):
        t = pq.read_table(path)
        if max_rows is not None:
            t = t.slice(0, max_rows)
        self.dense = np.stack([t[f"d{i}"].to_numpy() for i in range(N_DENSE)], 1).astype(np.float32)
        self.sparse = np.stack([t[f"s{i}"].to_numpy() for i in range(N_SPARSE)], 1).astype(np.int64) % buckets
        self.y = t["click"].to_numpy().astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.y[i]


class DCN(nn.Module):
    def __init__(self, buckets, dim, n_cross, deep):
        super().__init__()
        self.emb = nn.Embedding(N_SPARSE * buckets, dim)
        nn.init.normal_(self.emb.weight, std=0.01)
        self.register_buffer("base", torch.arange(N_SPARSE) * buckets, persistent=False)
        d0 = N_DENSE + N_SPARSE * dim
        self.cross_w = nn.ParameterList(nn.Parameter(torch.randn(d0) * 0.01) for _ in range(n_cross))
        self.cross_b = nn.ParameterList(nn.Parameter(torch.zeros(d0)) for _ in range(n_cross))
        layers, d = [], d0
        for h in deep:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU()]
            d = h
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(d0 + d, 1)

    def forward(self, dense, sparse):
        x0 = torch.cat([dense, self.emb(sparse + self.base).flatten(1)], 1)
        x = x0
        for w, b in zip(self.cross_w, self.cross_b):
            x = x0 * (x @ w).unsqueeze(1) + b + x
        return self.out(torch.cat([x, self.deep(x0)], 1)).squeeze(1)


def ckpt_path(root, day):
    return os.path.join(root, f"{day.isoformat()}", "model.pt")


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    nb = 5000
    h = torch.zeros(2, nb, dtype=torch.float64, device=device)
    s = torch.zeros(2, dtype=torch.float64, device=device)
    for dense, sparse, y in loader:
        dense, sparse, y = dense.to(device), sparse.to(device), y.to(device)
        logit = net(dense, sparse)
        s[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        s[1] += len(y)
        b = (torch.sigmoid(logit) * nb).long().clamp(max=nb - 1)
        h[0] += torch.bincount(b, weights=y.double(), minlength=nb)
        h[1] += torch.bincount(b, weights=1 - y.double(), minlength=nb)
    dist.all_reduce(h)
    dist.all_reduce(s)
    net.train()
    pos, neg = h
    auc = ((pos * (neg.cumsum(0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    return (s[0] / s[1]).item(), auc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--date", required=True)
    ap.add_argument("--samples", default="/mnt/juicefs/ads/samples")
    ap.add_argument("--ckpt_root", default="/mnt/juicefs/ads/models/dcn")
    ap.add_argument("--buckets", type=int, default=300_000)
    ap.add_argument("--dim", type=int, default=12)
    ap.add_argument("--n_cross", type=int, default=4)
    ap.add_argument("--deep", type=int, nargs="+", default=[1024, 512, 256])
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval_rows", type=int, default=2_000_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")

    today = date.fromisoformat(args.date)
    train_ds = DaySamples(os.path.join(args.samples, f"{today}.parquet"), args.buckets)
    eval_full = DaySamples(os.path.join(args.samples, f"{today + timedelta(days=1)}.parquet"),
                           args.buckets, max_rows=args.eval_rows)
    eval_ds = Subset(eval_full, range(rank, len(eval_full), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=int(today.strftime("%Y%m%d")), drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=16384, num_workers=2)

    torch.manual_seed(0)
    net = DCN(args.buckets, args.dim, args.n_cross, args.deep)
    prev = ckpt_path(args.ckpt_root, today - timedelta(days=1))
    if os.path.exists(prev):
        state = torch.load(prev, map_location="cpu")
        net.load_state_dict(state["model"])
        log.info("warm start from %s (auc %.5f)", prev, state["metrics"]["auc"])
    else:
        log.info("no checkpoint for the previous day, training from scratch")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    sampler.set_epoch(0)
    t0 = time.time()
    for step, (dense, sparse, y) in enumerate(train_dl):
        dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 500 == 0:
            log.info("step %d/%d loss %.5f %.0f ex/s", step, len(train_dl), loss.item(),
                     (step + 1) * args.batch_size * world / (time.time() - t0))

    logloss, auc = evaluate(model.module, eval_dl, device)
    log.info("eval on %s: logloss %.5f auc %.5f", today + timedelta(days=1), logloss, auc)

    if rank == 0:
        out = ckpt_path(args.ckpt_root, today)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        torch.save({"model": model.state_dict(), "date": args.date,
                    "metrics": {"auc": auc, "logloss": logloss}, "args": vars(args)}, out + ".tmp")
        os.replace(out + ".tmp", out)
        with open(os.path.join(os.path.dirname(out), "metrics.json"), "w") as f:
            json.dump({"auc": auc, "logloss": logloss, "train_rows": len(train_ds)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
