"""AutoInt+ for the homepage recommendation CTR task.

Data: daily binary dumps from the feature pipeline,
    {root}/{yyyymmdd}/feat.int32   (N x 40 hashed ids)
    {root}/{yyyymmdd}/label.uint8  (N)
Train on [start, end), evaluate on `end`.

Launch (2 nodes x 8 GPUs) with the cluster's torchrun wrapper, see scripts/launch_autoint.sh
"""
import argparse
import datetime as dt
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

NUM_FIELDS = 40


class DayDump(Dataset):
    def __init__(self, day_dir, hash_size):
        self.feat = np.memmap(os.path.join(day_dir, "feat.int32"), dtype=np.int32, mode="r").reshape(-1, NUM_FIELDS)
        self.label = np.memmap(os.path.join(day_dir, "label.uint8"), dtype=np.uint8, mode="r")
        self.hash_size = hash_size

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        ids = self.feat[i].astype(np.int64) % self.hash_size
        return torch.from_numpy(ids), torch.tensor(float(self.label[i]))


def days_between(start, end):
    d0 = dt.datetime.strptime(start, "%Y%m%d")
    d1 = dt.datetime.strptime(end, "%Y%m%d")
    return [(d0 + dt.timedelta(days=k)).strftime("%Y%m%d") for k in range((d1 - d0).days)]


class InteractingLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.res = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        out, _ = self.attn(x, x, x, need_weights=False)
        return F.relu(out + self.res(x))


class AutoIntPlus(nn.Module):
    def __init__(self, hash_size, dim=16, layers=3, heads=2, dnn=(400, 400)):
        super().__init__()
        self.embedding = nn.Embedding(NUM_FIELDS * hash_size, dim)
        nn.init.normal_(self.embedding.weight, std=1e-4)
        self.register_buffer("offsets", torch.arange(NUM_FIELDS) * hash_size, persistent=False)
        self.interacting = nn.Sequential(*[InteractingLayer(dim, heads) for _ in range(layers)])
        mlp, d = [], NUM_FIELDS * dim
        for h in dnn:
            mlp += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.dnn = nn.Sequential(*mlp)
        self.out = nn.Linear(NUM_FIELDS * dim + d, 1)

    def forward(self, ids):
        e = self.embedding(ids + self.offsets)
        att = self.interacting(e).flatten(1)
        deep = self.dnn(e.flatten(1))
        return self.out(torch.cat([att, deep], 1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device, n_bins=1000):
    net.eval()
    loss_sum, count = 0.0, 0
    pos_hist = np.zeros(n_bins, dtype=np.float64)
    neg_hist = np.zeros(n_bins, dtype=np.float64)
    for ids, y in loader:
        logits = net(ids.to(device, non_blocking=True))
        y = y.to(device, non_blocking=True)
        loss_sum += F.binary_cross_entropy_with_logits(logits, y, reduction="sum").item()
        count += y.numel()
        p = torch.sigmoid(logits).cpu().numpy()
        yy = y.cpu().numpy()
        pos_hist += np.histogram(p[yy > 0.5], bins=n_bins, range=(0.0, 1.0))[0]
        neg_hist += np.histogram(p[yy <= 0.5], bins=n_bins, range=(0.0, 1.0))[0]
    net.train()

    stats = torch.tensor([loss_sum, count], dtype=torch.float64)
    pos_t = torch.from_numpy(pos_hist)
    neg_t = torch.from_numpy(neg_hist)
    for t in (stats, pos_t, neg_t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    neg_below = torch.cumsum(neg_t, 0) - neg_t
    auc = ((pos_t * (neg_below + 0.5 * neg_t)).sum() / (pos_t.sum() * neg_t.sum())).item()
    return stats[0].item() / stats[1].item(), auc


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/mnt/cfs/homepage_rec/dumps")
    p.add_argument("--start", default="20240501")
    p.add_argument("--end", default="20240508")
    p.add_argument("--hash_size", type=int, default=100_000)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--logdir", default="/mnt/cfs/homepage_rec/runs/autoint")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = ConcatDataset([DayDump(os.path.join(args.root, d), args.hash_size)
                              for d in days_between(args.start, args.end)])
    eval_ds = DayDump(os.path.join(args.root, args.end), args.hash_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1, drop_last=True)
    eval_idx = list(range(rank, len(eval_ds), world))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=10, pin_memory=True, drop_last=True, persistent_workers=True)
    eval_dl = DataLoader(torch.utils.data.Subset(eval_ds, eval_idx), batch_size=8192,
                         num_workers=4, pin_memory=True)

    torch.manual_seed(1)
    model = DDP(AutoIntPlus(args.hash_size).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = len(train_dl)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    train_sampler.set_epoch(0)
    t0 = time.time()
    for step, (ids, y) in enumerate(train_dl):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total_steps, args.warmup, args.lr)
        ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.binary_cross_entropy_with_logits(model(ids), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                writer.add_scalar("train/loss", avg.item() / world, step)
                writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
                writer.add_scalar("train/samples_per_s",
                                  100 * args.batch_size * world / (time.time() - t0), step)
                t0 = time.time()

    logloss, auc = evaluate(model.module, eval_dl, device)
    if rank == 0:
        print(f"eval {args.end}: logloss={logloss:.5f} auc={auc:.5f}", flush=True)
        writer.add_scalar("eval/logloss", logloss, total_steps)
        writer.add_scalar("eval/auc", auc, total_steps)
        writer.close()
        torch.save(model.module.state_dict(), os.path.join(args.logdir, f"autoint_{args.end}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
