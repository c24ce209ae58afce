"""Field-aware-ish FM (FwFM) CTR model with streaming calibration metrics.

Eval uses a bucketed AUC (like tf.metrics.auc with 10k thresholds) so that we
never have to gather all predictions: every rank fills its own histograms and
they are summed across ranks.

    torchrun --nproc_per_node=8 20_fm_ctr_calibration.py --data_dir /data/ctr/fwfm_v3 --save_dir /data/ctr/models/fwfm
"""
import argparse
import glob
import logging
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

FIELDS = ["uid_bucket", "age", "gender", "city", "ad_id", "adgroup", "category", "brand", "pid", "weekday", "hour"]
FIELD_SIZES = [1_000_000, 10, 3, 400, 900_000, 500_000, 7000, 100_000, 12, 7, 24]
N_BINS = 10_000
logger = logging.getLogger("fwfm")


def load_split(data_dir, split):
    files = sorted(glob.glob(os.path.join(data_dir, split, "*.parquet")))
    df = pd.concat([pd.read_parquet(f, columns=FIELDS + ["clk"]) for f in files], ignore_index=True)
    x = np.stack([df[c].to_numpy(np.int64) % n for c, n in zip(FIELDS, FIELD_SIZES)], 1)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(df["clk"].to_numpy(np.float32)))


class FwFM(nn.Module):
    def __init__(self, field_sizes, dim=12):
        super().__init__()
        self.n_fields = len(field_sizes)
        offsets = np.concatenate([[0], np.cumsum(field_sizes)[:-1]])
        self.register_buffer("offsets", torch.as_tensor(offsets, dtype=torch.long), persistent=False)
        total = int(sum(field_sizes))
        self.v = nn.Embedding(total, dim)
        self.w = nn.Embedding(total, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.r = nn.Parameter(torch.ones(self.n_fields, self.n_fields) * 0.1)  # field-pair weights
        nn.init.normal_(self.v.weight, std=0.01)
        nn.init.zeros_(self.w.weight)
        i, j = torch.triu_indices(self.n_fields, self.n_fields, 1)
        self.register_buffer("pi", i, persistent=False)
        self.register_buffer("pj", j, persistent=False)

    def forward(self, x):
        idx = x + self.offsets
        e = self.v(idx)                                   # B x F x D
        inter = (e[:, self.pi] * e[:, self.pj]).sum(-1)   # B x P
        pair_w = self.r[self.pi, self.pj]
        return self.bias + self.w(idx).sum((1, 2)) + (inter * pair_w).sum(1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    pos_hist = np.zeros(N_BINS, np.float64)
    neg_hist = np.zeros(N_BINS, np.float64)
    ll_sum, p_sum, y_sum, n = 0.0, 0.0, 0.0, 0
    for x, y in loader:
        p = torch.sigmoid(net(x.to(device, non_blocking=True))).double().cpu().numpy()
        y = y.double().numpy()
        pc = np.clip(p, 1e-7, 1 - 1e-7)
        ll_sum += float(-(y * np.log(pc) + (1 - y) * np.log(1 - pc)).sum())
        p_sum += float(p.sum())
        y_sum += float(y.sum())
        n += len(y)
        b = np.minimum((p * N_BINS).astype(np.int64), N_BINS - 1)
        pos_hist += np.bincount(b, weights=y, minlength=N_BINS)
        neg_hist += np.bincount(b, weights=1 - y, minlength=N_BINS)
    net.train()

    scalars = torch.tensor([ll_sum, p_sum, y_sum, float(n)], dtype=torch.float64)
    hist = torch.from_numpy(np.stack([pos_hist, neg_hist]))
    dist.all_reduce(scalars)
    dist.all_reduce(hist)
    ll_sum, p_sum, y_sum, n = scalars.tolist()
    pos, neg = hist[0].numpy(), hist[1].numpy()

    # AUC from histograms: P(score_pos > score_neg) + 0.5 * P(tie within a bin)
    neg_below = np.cumsum(neg) - neg
    auc = (pos * neg_below).sum() + 0.5 * (pos * neg).sum()
    auc /= max(pos.sum() * neg.sum(), 1.0)
    return {"auc": float(auc), "logloss": ll_sum / n, "copc": y_sum / max(p_sum, 1e-9),
            "ctr": y_sum / n, "n": int(n)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--dim", type=int, default=12)
    ap.add_argument("--batch_size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--l2", type=float, default=1e-7)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_ds = load_split(args.data_dir, "train")
    val_ds = load_split(args.data_dir, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=32768, num_workers=4,
                        pin_memory=True)

    torch.manual_seed(0)
    model = DDP(FwFM(FIELD_SIZES, args.dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr, weight_decay=args.l2)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) * max(0.1, 1 - s / total))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        logger.info("train %d  val %d  steps/epoch %d", len(train_ds), len(val_ds), len(train_dl))

    best = -math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_dl, 1):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 500 == 0:
                dist.all_reduce(acc)
                logger.info("epoch %d step %d loss %.5f lr %.4f %.0f samples/s", epoch, step,
                            (acc[0] / acc[1]).item(), sched.get_last_lr()[0],
                            500 * args.batch_size * world / (time.time() - t0))
                acc.zero_()
                t0 = time.time()

        m = evaluate(model.module, val_dl, device)
        logger.info("epoch %d val %s", epoch, {k: round(v, 5) for k, v in m.items()})
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                       os.path.join(args.save_dir, f"fwfm_e{epoch}.pt"))
            if m["auc"] > best:
                best = m["auc"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                           os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
