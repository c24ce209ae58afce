#!/usr/bin/env python3
"""MMoE multi-task ranking for the short-video feed (finish / like / share).

Launch on one 8-GPU box:
    torchrun --nproc_per_node=8 17_mmoe_video_feed.py --date 2024-11-20 --days 5
"""
import argparse
import logging
import os
import time
from datetime import datetime, timedelta

import numpy as np
import pyarrow.dataset as pads
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TASKS = ["finish", "like", "share"]
SLOTS = 48


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--data", default="/mnt/hdfs/feed/samples_v7")
    p.add_argument("--date", default="2024-11-20", help="evaluation date; trains on the days before")
    p.add_argument("--days", type=int, default=5)
    p.add_argument("--slot_hash", type=int, default=250_000)
    p.add_argument("--emb_dim", type=int, default=16)
    p.add_argument("--experts", type=int, default=6)
    p.add_argument("--expert_dim", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--task_weights", default="1.0,0.5,0.5")
    p.add_argument("--save_dir", default="/mnt/hdfs/feed/models/mmoe")
    return p


def load_partition(root, day):
    ds = pads.dataset(os.path.join(root, f"date={day}"), format="parquet")
    tbl = ds.to_table(columns=["slots"] + TASKS)
    slots = np.stack(tbl.column("slots").to_numpy(zero_copy_only=False)).astype(np.int64)
    labels = np.stack([tbl.column(t).to_numpy() for t in TASKS], 1).astype(np.float32)
    return slots, labels


class MMoE(nn.Module):
    def __init__(self, slot_hash, emb_dim, n_experts, expert_dim, n_tasks):
        super().__init__()
        self.slot_hash = slot_hash
        self.emb = nn.Embedding(SLOTS * slot_hash, emb_dim)
        nn.init.normal_(self.emb.weight, std=0.01)
        self.register_buffer("slot_base", torch.arange(SLOTS) * slot_hash, persistent=False)
        d_in = SLOTS * emb_dim
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_in, 512), nn.ReLU(), nn.Linear(512, expert_dim), nn.ReLU())
            for _ in range(n_experts))
        self.gates = nn.ModuleList(nn.Linear(d_in, n_experts) for _ in range(n_tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(expert_dim, 128), nn.ReLU(), nn.Linear(128, 1))
            for _ in range(n_tasks))

    def forward(self, slots):
        x = self.emb(slots % self.slot_hash + self.slot_base).flatten(1)
        ex = torch.stack([e(x) for e in self.experts], 1)            # B, E, H
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = torch.softmax(gate(x), dim=-1).unsqueeze(-1)          # B, E, 1
            outs.append(tower((w * ex).sum(1)).squeeze(-1))
        return torch.stack(outs, 1)                                   # B, T


def auc_hist(prob, label, bins=2048):
    b = (prob * bins).long().clamp(max=bins - 1)
    pos = torch.bincount(b, weights=label.double(), minlength=bins)
    neg = torch.bincount(b, weights=1 - label.double(), minlength=bins)
    return torch.stack([pos, neg])


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    log = logging.getLogger("mmoe")

    eval_day = datetime.strptime(args.date, "%Y-%m-%d")
    train_days = [(eval_day - timedelta(days=k)).strftime("%Y-%m-%d") for k in range(args.days, 0, -1)]
    parts = [load_partition(args.data, d) for d in train_days]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    train_ds = TensorDataset(x, y)
    ex, ey = load_partition(args.data, args.date)
    eval_ds = TensorDataset(torch.from_numpy(ex[rank::world]), torch.from_numpy(ey[rank::world]))
    log.info("train rows %d (%s..%s), eval rows %d", len(train_ds), train_days[0], train_days[-1], len(ex))

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=8192, num_workers=2)

    torch.manual_seed(0)
    model = MMoE(args.slot_hash, args.emb_dim, args.experts, args.expert_dim, len(TASKS)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    task_w = torch.tensor([float(w) for w in args.task_weights.split(",")], device=device)

    sampler.set_epoch(0)
    model.train()
    t0 = time.time()
    for step, (xb, yb) in enumerate(loader):
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        logits = model(xb)
        per_task = F.binary_cross_entropy_with_logits(logits, yb, reduction="none").mean(0)
        loss = (per_task * task_w).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 200 == 0:
            pt = per_task.detach()
            dist.all_reduce(pt, op=dist.ReduceOp.AVG)
            log.info("step %d/%d %s  %.0f ex/s", step, len(loader),
                     " ".join(f"{t}={v:.4f}" for t, v in zip(TASKS, pt.tolist())),
                     (step + 1) * args.batch_size * world / (time.time() - t0))

    net = model.module
    net.eval()
    hist = torch.zeros(len(TASKS), 2, 2048, dtype=torch.float64, device=device)
    with torch.no_grad():
        for xb, yb in eval_loader:
            prob = torch.sigmoid(net(xb.to(device)))
            yb = yb.to(device)
            for t in range(len(TASKS)):
                hist[t] += auc_hist(prob[:, t], yb[:, t])
    dist.all_reduce(hist)
    aucs = {}
    for t, name in enumerate(TASKS):
        pos, neg = hist[t]
        aucs[name] = ((pos * (neg.cumsum(0) - 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    log.info("eval %s: %s", args.date, aucs)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save({"model": net.state_dict(), "aucs": aucs, "args": vars(args)},
                   os.path.join(args.save_dir, f"mmoe_{args.date}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
