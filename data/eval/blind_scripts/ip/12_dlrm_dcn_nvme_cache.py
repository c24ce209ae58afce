#!/usr/bin/env python3
"""DLRM-DCNv2 on hashed Criteo-format day files, multi-node.

Raw day files live on the shared filesystem; each node converts the window it needs into a
compact binary cache on its local NVMe once (first run), then every rank on that node
memory-maps it. Checkpoints and logs go to the shared filesystem.

    # on every node
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        12_dlrm_dcn_nvme_cache.py --days 0 1 2 3 4 5 --eval_day 6
"""
import argparse
import datetime
import math
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_DENSE, N_SPARSE = 13, 26


def convert_day(src, dst_prefix, hash_size):
    """TSV -> dense.f32 / sparse.i32 / label.u8, written under temporary names first."""
    dense, sparse, label = [], [], []
    with open(src) as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            label.append(int(cols[0]))
            dense.append([float(c) if c else 0.0 for c in cols[1:14]])
            sparse.append([(int(c, 16) % hash_size) if c else 0 for c in cols[14:40]])
    arrays = {"dense.f32": np.log1p(np.maximum(np.asarray(dense, np.float32), 0)),
              "sparse.i32": np.asarray(sparse, np.int32),
              "label.u8": np.asarray(label, np.uint8)}
    for suffix, arr in arrays.items():
        tmp = f"{dst_prefix}.{suffix}.tmp{os.getpid()}"
        arr.tofile(tmp)
        os.replace(tmp, f"{dst_prefix}.{suffix}")


class CachedDay(Dataset):
    def __init__(self, prefix):
        self.label = np.fromfile(f"{prefix}.label.u8", dtype=np.uint8)
        n = len(self.label)
        self.dense = np.memmap(f"{prefix}.dense.f32", dtype=np.float32, mode="r", shape=(n, N_DENSE))
        self.sparse = np.memmap(f"{prefix}.sparse.i32", dtype=np.int32, mode="r", shape=(n, N_SPARSE))

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return (torch.from_numpy(np.array(self.dense[i])),
                torch.from_numpy(self.sparse[i].astype(np.int64)),
                torch.tensor(float(self.label[i])))


class DLRMDCN(nn.Module):
    def __init__(self, hash_size, dim=64, bottom=(512, 256), cross_layers=3, rank=512,
                 top=(1024, 1024, 512, 256)):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(hash_size, dim) for _ in range(N_SPARSE))
        b, d = [], N_DENSE
        for h in (*bottom, dim):
            b += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.bottom = nn.Sequential(*b)
        x_dim = (N_SPARSE + 1) * dim
        self.U = nn.ModuleList(nn.Linear(x_dim, rank, bias=False) for _ in range(cross_layers))
        self.V = nn.ModuleList(nn.Linear(rank, x_dim) for _ in range(cross_layers))
        t, d = [], x_dim
        for h in top:
            t += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.top = nn.Sequential(*t, nn.Linear(d, 1))

    def forward(self, dense, sparse):
        x0 = torch.cat([self.bottom(dense)] + [e(sparse[:, i]) for i, e in enumerate(self.emb)], 1)
        x = x0
        for u, v in zip(self.U, self.V):
            x = x0 * v(u(x)) + x
        return self.top(x).squeeze(1)


def lr_at(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def strip_prefix(sd):
    return {re.sub(r"^module\.", "", k): v for k, v in sd.items()}


@torch.no_grad()
def evaluate(net, loader, device, bins=8192):
    net.eval()
    h = torch.zeros(2, bins, dtype=torch.float64, device=device)
    s = torch.zeros(2, dtype=torch.float64, device=device)
    for dense, sparse, y in loader:
        dense, sparse, y = dense.to(device), sparse.to(device), y.to(device)
        logit = net(dense, sparse)
        s[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        s[1] += y.numel()
        b = (torch.sigmoid(logit) * bins).long().clamp(max=bins - 1)
        h[0] += torch.bincount(b, weights=y.double(), minlength=bins)
        h[1] += torch.bincount(b, weights=(1 - y).double(), minlength=bins)
    dist.all_reduce(h)
    dist.all_reduce(s)
    net.train()
    pos, neg = h
    auc = (pos * (neg.cumsum(0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())
    return (s[0] / s[1]).item(), auc.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw_dir", default="/shared/criteo/raw")
    ap.add_argument("--cache_dir", default="/local_nvme/criteo_cache")
    ap.add_argument("--days", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--eval_day", type=int, default=6)
    ap.add_argument("--hash_size", type=int, default=200_000)
    ap.add_argument("--batch_size", type=int, default=2048, help="per GPU, per micro-batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base_lr", type=float, default=5e-4, help="for a global batch of 16384")
    ap.add_argument("--warmup_frac", type=float, default=0.05)
    ap.add_argument("--ckpt_dir", default="/shared/criteo/ckpt/dlrm_dcn")
    ap.add_argument("--init_from", default="", help="warm start from a previous day's model")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run on a node spends a long time converting raw days before the barrier below
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # one converter per node; the cache is node-local so every node needs its own copy
    prefixes = {d: os.path.join(args.cache_dir, f"day_{d}_h{args.hash_size}")
                for d in args.days + [args.eval_day]}
    if local_rank == 0:
        os.makedirs(args.cache_dir, exist_ok=True)
        for d, prefix in prefixes.items():
            if not os.path.exists(f"{prefix}.label.u8"):
                convert_day(os.path.join(args.raw_dir, f"day_{d}"), prefix, args.hash_size)
    dist.barrier()

    train_ds = ConcatDataset([CachedDay(prefixes[d]) for d in args.days])
    eval_full = CachedDay(prefixes[args.eval_day])
    eval_ds = Subset(eval_full, range(rank, len(eval_full), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=123, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(eval_ds, batch_size=16384, num_workers=4, pin_memory=True)

    global_batch = args.batch_size * args.accum * world
    peak_lr = args.base_lr * global_batch / 16384
    total_updates = len(loader) // args.accum
    warmup = int(args.warmup_frac * total_updates)

    torch.manual_seed(123)
    net = DLRMDCN(args.hash_size).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=peak_lr)
    if args.init_from:
        ckpt = torch.load(args.init_from, map_location="cpu")
        # older runs saved the DDP wrapper's state dict
        net.load_state_dict(strip_prefix(ckpt["model"]))
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)

    run = None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        run = wandb.init(project="criteo-dlrm-dcn", config={**vars(args), "world": world,
                                                            "global_batch": global_batch,
                                                            "peak_lr": peak_lr})

    sampler.set_epoch(0)
    update, t0 = 0, time.time()
    opt.zero_grad(set_to_none=True)
    for i, (dense, sparse, y) in enumerate(loader):
        if update >= total_updates:
            break
        dense, sparse, y = (t.to(device, non_blocking=True) for t in (dense, sparse, y))
        boundary = (i + 1) % args.accum == 0
        if boundary:
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y) / args.accum
            loss.backward()
        else:
            with model.no_sync():
                loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y) / args.accum
                loss.backward()
            continue
        for g in opt.param_groups:
            g["lr"] = lr_at(update, total_updates, warmup, peak_lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update += 1
        if rank == 0 and update % 200 == 0:
            run.log({"loss": loss.item() * args.accum, "lr": opt.param_groups[0]["lr"],
                     "ex_per_s": 200 * global_batch / (time.time() - t0)}, step=update)
            t0 = time.time()
        if update % 5000 == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "update": update},
                       os.path.join(args.ckpt_dir, "latest.pt"))

    logloss, auc = evaluate(model.module, eval_loader, device)
    if rank == 0:
        run.summary.update({"eval_logloss": logloss, "eval_auc": auc})
        print(f"day {args.eval_day}: logloss {logloss:.5f} auc {auc:.5f}", flush=True)
        torch.save({"model": model.module.state_dict(), "update": update,
                    "eval": {"auc": auc, "logloss": logloss}},
                   os.path.join(args.ckpt_dir, "final.pt"))
        run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
