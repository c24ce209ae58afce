#!/usr/bin/env python
# DLRM on Criteo 1TB (preprocessed to per-day .npy by tools/split_days.py).
# Data parallel: every rank keeps a full copy of the (capped) tables.
#
#   torchrun --nproc_per_node=8 03_criteo_resume_ddp.py --resume /nfs/dlrm/ckpt/last.pt
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)

CRITEO_CARDINALITIES = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]


class CriteoDays(Dataset):
    """Batch-level dataset over memory-mapped day files: item i is batch i."""

    def __init__(self, root, days, batch_size, max_rows):
        self.batch_size = batch_size
        self.caps = np.array([min(c, max_rows) for c in CRITEO_CARDINALITIES], dtype=np.int64)
        self.dense, self.sparse, self.labels, self.offsets = [], [], [], [0]
        for d in days:
            self.dense.append(np.load(os.path.join(root, f"day_{d}_dense.npy"), mmap_mode="r"))
            self.sparse.append(np.load(os.path.join(root, f"day_{d}_sparse.npy"), mmap_mode="r"))
            self.labels.append(np.load(os.path.join(root, f"day_{d}_labels.npy"), mmap_mode="r"))
            self.offsets.append(self.offsets[-1] + len(self.labels[-1]) // batch_size)

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, i):
        day = int(np.searchsorted(self.offsets, i, side="right") - 1)
        s = (i - self.offsets[day]) * self.batch_size
        e = s + self.batch_size
        dense = np.log1p(np.asarray(self.dense[day][s:e], dtype=np.float32))
        sparse = np.asarray(self.sparse[day][s:e], dtype=np.int64) % self.caps
        label = np.asarray(self.labels[day][s:e], dtype=np.float32)
        return torch.from_numpy(dense), torch.from_numpy(sparse), torch.from_numpy(label)


class DLRM(nn.Module):
    def __init__(self, table_sizes, dim=64, bottom=(512, 256, 64), top=(1024, 1024, 512, 256)):
        super().__init__()
        b, prev = [], 13
        for h in bottom:
            b += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        self.bot = nn.Sequential(*b)
        self.emb = nn.ModuleList(nn.EmbeddingBag(int(n), dim, mode="sum") for n in table_sizes)
        f = len(table_sizes) + 1
        t, prev = [], dim + f * (f - 1) // 2
        for h in top:
            t += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        t.append(nn.Linear(prev, 1))
        self.top = nn.Sequential(*t)
        self.register_buffer("li", torch.tril_indices(f, f, -1)[0], persistent=False)
        self.register_buffer("lj", torch.tril_indices(f, f, -1)[1], persistent=False)

    def forward(self, dense, sparse):
        x = self.bot(dense)
        embs = [tab(sparse[:, k:k + 1]) for k, tab in enumerate(self.emb)]
        T = torch.stack([x] + embs, 1)
        Z = torch.bmm(T, T.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, Z], 1)).squeeze(-1)


def binned_auc(pos, neg):
    neg_lt = torch.cumsum(neg, 0) - neg
    return ((pos * (neg_lt + neg / 2)).sum() / (pos.sum() * neg.sum())).item()


@torch.no_grad()
def evaluate(net, ds, rank, world, device, bins=20000):
    net.eval()
    n = len(ds) // world * world
    pos = torch.zeros(bins, dtype=torch.float64, device=device)
    neg = torch.zeros(bins, dtype=torch.float64, device=device)
    bce = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(rank, n, world):
        dense, sparse, y = (t.to(device, non_blocking=True) for t in ds[i])
        logit = net(dense, sparse)
        bce[0] += nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        bce[1] += y.numel()
        idx = (torch.sigmoid(logit) * bins).long().clamp(max=bins - 1)
        pos += torch.bincount(idx, weights=y.double(), minlength=bins)
        neg += torch.bincount(idx, weights=(1 - y).double(), minlength=bins)
    dist.all_reduce(pos)
    dist.all_reduce(neg)
    dist.all_reduce(bce)
    net.train()
    return (bce[0] / bce[1]).item(), binned_auc(pos, neg)


def save_checkpoint(path, model, opt, epoch, step):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/nfs/criteo1tb/npy")
    ap.add_argument("--train_days", default="0-22")
    ap.add_argument("--eval_day", type=int, default=23)
    ap.add_argument("--max_rows", type=int, default=500_000)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--ckpt_every", type=int, default=20000)
    ap.add_argument("--ckpt_dir", default="/nfs/dlrm/ckpt")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    lo, hi = (int(x) for x in args.train_days.split("-"))
    train_ds = CriteoDays(args.data, range(lo, hi + 1), args.batch_size, args.max_rows)
    eval_ds = CriteoDays(args.data, [args.eval_day], 16384, args.max_rows)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=None, sampler=sampler, num_workers=8,
                        pin_memory=True, prefetch_factor=4, persistent_workers=True)

    torch.manual_seed(0)
    net = DLRM(train_ds.caps).to(device)
    opt = torch.optim.Adagrad(net.parameters(), lr=args.lr)
    start_epoch, step = 0, 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"], ckpt["step"]
        del ckpt
        logger.info("resumed from %s at epoch %d step %d", args.resume, start_epoch, step)
    model = DistributedDataParallel(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    loss_fn = nn.BCEWithLogitsLoss()

    steps_per_epoch = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch
        t0 = time.time()
        for i, (dense, sparse, y) in enumerate(loader):
            if i < skip:
                continue
            dense, sparse, y = dense.to(device), sparse.to(device), y.to(device)
            loss = loss_fn(model(dense, sparse), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 1000 == 0:
                logger.info("epoch %d step %d loss %.4f (%.1f it/s)",
                            epoch, step, loss.item(), 1000 / (time.time() - t0))
                t0 = time.time()
            if step % args.ckpt_every == 0:
                if rank == 0:
                    save_checkpoint(os.path.join(args.ckpt_dir, "last.pt"), model, opt, epoch, step)
                dist.barrier()

        logloss, auc = evaluate(model.module, eval_ds, rank, world, device)
        logger.info("epoch %d eval logloss %.5f auc %.5f", epoch, logloss, auc)
        if rank == 0:
            save_checkpoint(os.path.join(args.ckpt_dir, "last.pt"), model, opt, epoch + 1, step)
            save_checkpoint(os.path.join(args.ckpt_dir, f"epoch{epoch}.pt"), model, opt,
                            epoch + 1, step)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
