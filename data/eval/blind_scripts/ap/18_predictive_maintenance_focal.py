"""Predictive maintenance: will a machine fail within the next 7 days?

Daily machine snapshots (telemetry aggregates, error counts, days since component
replacement, model/age). Focal loss for the ~1.5% positive rate. Time split by date.

    torchrun --nproc_per_node=4 18_predictive_maintenance_focal.py --snapshots data/pdm/daily_snapshots.parquet
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
from sklearn.metrics import average_precision_score, f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("pdm")

CAT_COLS = ["model", "site", "firmware"]
TARGET = "fail_within_7d"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--snapshots", default="data/pdm/daily_snapshots.parquet")
    p.add_argument("--train-end", default="2023-06-30")
    p.add_argument("--valid-end", default="2023-09-30")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--gamma", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.75)
    p.add_argument("--ckpt", default="checkpoints/pdm")
    return p.parse_args()


class FocalLoss(nn.Module):
    def __init__(self, alpha=0.75, gamma=2.0):
        super().__init__()
        self.alpha, self.gamma = alpha, gamma

    def forward(self, logits, target):
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        p_t = torch.exp(-bce)
        a_t = self.alpha * target + (1 - self.alpha) * (1 - target)
        return (a_t * (1 - p_t) ** self.gamma * bce).mean()


class PdMNet(nn.Module):
    def __init__(self, cards, n_num, d_emb=8, hidden=256):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(c + 1, d_emb) for c in cards])
        d_in = d_emb * len(cards) + n_num
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.15),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.15),
            nn.Linear(hidden, 1))

    def forward(self, xc, xn):
        return self.net(torch.cat([e(xc[:, i]) for i, e in enumerate(self.emb)] + [xn], 1)).squeeze(-1)


def make_tensors(frame, vocab, num_cols, stats):
    xc = np.stack([frame[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64).values for c in CAT_COLS], 1)
    xn = ((frame[num_cols] - stats[0]) / stats[1]).fillna(0).clip(-6, 6).values.astype(np.float32)
    return TensorDataset(torch.arange(len(frame)), torch.from_numpy(xc), torch.from_numpy(xn),
                         torch.from_numpy(frame[TARGET].values.astype(np.float32)))


@torch.no_grad()
def evaluate(model, loader, y_true, device, world_size):
    model.eval()
    idx_l, p_l = [], []
    for idx, xc, xn, _ in loader:
        idx_l.append(idx)
        p_l.append(torch.sigmoid(model(xc.to(device), xn.to(device))).cpu())
    parts = [None] * world_size
    dist.all_gather_object(parts, (torch.cat(idx_l).numpy(), torch.cat(p_l).numpy()))
    idx = np.concatenate([a for a, _ in parts])
    prob = np.concatenate([b for _, b in parts])
    idx, first = np.unique(idx, return_index=True)
    prob, y = prob[first], y_true[idx]
    thresholds = np.linspace(0.05, 0.95, 19)
    f1s = [f1_score(y, prob >= t) for t in thresholds]
    return {"auc": roc_auc_score(y, prob), "ap": average_precision_score(y, prob),
            "best_f1": float(np.max(f1s)), "best_thr": float(thresholds[int(np.argmax(f1s))])}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(123)

    df = pd.read_parquet(args.snapshots)
    df["date"] = pd.to_datetime(df["date"])
    num_cols = [c for c in df.columns if c not in CAT_COLS + [TARGET, "date", "machine_id"]]
    train = df[df["date"] <= args.train_end]
    valid = df[(df["date"] > args.train_end) & (df["date"] <= args.valid_end)]
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(train[c].astype(str).unique()))} for c in CAT_COLS}
    stats = (train[num_cols].mean(), train[num_cols].std().replace(0, 1))
    train_ds = make_tensors(train, vocab, num_cols, stats)
    valid_ds = make_tensors(valid, vocab, num_cols, stats)
    y_valid = valid_ds.tensors[3].numpy()
    logger.info("train %d snapshots (%.2f%% pos), valid %d", len(train_ds), 100 * train[TARGET].mean(), len(valid_ds))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=4096, sampler=DistributedSampler(valid_ds, shuffle=False))

    model = DDP(PdMNet([len(vocab[c]) for c in CAT_COLS], len(num_cols)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world_size,
                                                total_steps=args.epochs * len(train_loader), pct_start=0.2)
    criterion = FocalLoss(args.alpha, args.gamma)
    os.makedirs(args.ckpt, exist_ok=True)

    best_ap = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for _, xc, xn, y in train_loader:
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(xc, xn), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(loss_sum)

        if rank == 0:
            m = evaluate(model, valid_loader, y_valid, device, world_size)
            logger.info("epoch %02d | focal %.5f | AUC %.4f AP %.4f F1 %.4f@%.2f | %.0fs", epoch,
                        (loss_sum[0] / loss_sum[1]).item(), m["auc"], m["ap"], m["best_f1"], m["best_thr"],
                        time.time() - t0)
            if m["ap"] > best_ap:
                best_ap = m["ap"]
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "num_cols": num_cols,
                            "mean": stats[0].to_dict(), "std": stats[1].to_dict(), "threshold": m["best_thr"]},
                           os.path.join(args.ckpt, "pdm_best.pt"))
        dist.barrier()

    logger.info("best valid AP %.4f", best_ap)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
