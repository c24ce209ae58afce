#!/usr/bin/env python
"""Seizure detection on CHB-MIT scalp EEG with a 1D CNN.

Recordings are pre-converted to per-patient .npz files (see prepare_chbmit.py):
    signals:      float32 [n_channels, n_samples] at 256 Hz (18-ch bipolar montage)
    seizure_mask: uint8   [n_samples], 1 inside annotated seizures

Patients are split into k folds; --fold selects the held-out patients.

    torchrun --nproc_per_node=4 01_chbmit_seizure_cnn.py --data_dir /data/chbmit_npz --fold 0
"""
import argparse
import glob
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("chbmit")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="runs/chbmit")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--n_val_patients", type=int, default=2)
    p.add_argument("--fs", type=int, default=256)
    p.add_argument("--win_sec", type=float, default=4.0)
    p.add_argument("--train_hop_sec", type=float, default=1.0)
    p.add_argument("--eval_hop_sec", type=float, default=4.0)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--pos_weight", type=float, default=20.0)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class WindowDataset(Dataset):
    """Sliding windows over a list of long recordings, cut lazily in __getitem__."""

    def __init__(self, files, win, hop):
        self.win = win
        self.signals, self.masks, self.index = [], [], []
        for i, f in enumerate(files):
            d = np.load(f)
            x = d["signals"].astype(np.float32)
            x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-6)
            self.signals.append(x)
            self.masks.append(d["seizure_mask"].astype(np.float32))
            for s in range(0, x.shape[1] - win + 1, hop):
                self.index.append((i, s))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        x = np.ascontiguousarray(self.signals[i][:, s:s + self.win])
        # a window counts as ictal when most of it lies inside a seizure
        y = float(self.masks[i][s:s + self.win].mean() > 0.5)
        return torch.from_numpy(x), torch.tensor(y, dtype=torch.float32)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, k, pool):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm1d(cout)
        self.pool = nn.MaxPool1d(pool)

    def forward(self, x):
        return self.pool(F.elu(self.bn(self.conv(x))))


class SeizureCNN(nn.Module):
    def __init__(self, n_ch=18, width=64, dropout=0.3):
        super().__init__()
        self.features = nn.Sequential(
            ConvBlock(n_ch, width, 7, 4),
            ConvBlock(width, width * 2, 5, 4),
            ConvBlock(width * 2, width * 2, 5, 4),
            ConvBlock(width * 2, width * 4, 3, 2),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(width * 4, 1)
        )

    def forward(self, x):
        return self.head(self.features(x)).squeeze(1)


def split_patients(data_dir, fold, n_folds, n_val, seed):
    files = sorted(glob.glob(os.path.join(data_dir, "chb*.npz")))
    kf = KFold(n_splits=n_folds, shuffle=True, random_state=seed)
    train_idx, test_idx = list(kf.split(files))[fold]
    rng = np.random.RandomState(seed + fold)
    train_idx = rng.permutation(train_idx)
    val_idx, train_idx = train_idx[:n_val], train_idx[n_val:]
    pick = lambda idx: [files[i] for i in sorted(idx)]
    return pick(train_idx), pick(val_idx), pick(test_idx)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, labels = [], []
    loss_sum, n = 0.0, 0
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += F.binary_cross_entropy_with_logits(logits, y, reduction="sum").item()
        n += y.numel()
        probs.append(torch.sigmoid(logits).float().cpu())
        labels.append(y.cpu())
    probs = torch.cat(probs).numpy()
    labels = torch.cat(labels).numpy()
    auroc = roc_auc_score(labels, probs) if labels.min() != labels.max() else float("nan")
    f1 = f1_score(labels.astype(int), (probs > 0.5).astype(int), zero_division=0)
    return {"loss": loss_sum / max(n, 1), "auroc": float(auroc), "f1": float(f1)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cudnn.benchmark = True

    out_dir = os.path.join(args.out_dir, f"fold{args.fold}")
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_files, val_files, test_files = split_patients(
        args.data_dir, args.fold, args.n_folds, args.n_val_patients, args.seed
    )
    logger.info("patients train=%d val=%d test=%d", len(train_files), len(val_files), len(test_files))

    win = int(args.win_sec * args.fs)
    train_ds = WindowDataset(train_files, win, int(args.train_hop_sec * args.fs))
    val_ds = WindowDataset(val_files, win, int(args.eval_hop_sec * args.fs))
    test_ds = WindowDataset(test_files, win, int(args.eval_hop_sec * args.fs))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    loader_kw = dict(num_workers=args.num_workers, pin_memory=True, persistent_workers=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True, **loader_kw)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler, **loader_kw)
    test_loader = DataLoader(test_ds, batch_size=args.batch_size * 2, sampler=test_sampler, **loader_kw)

    model = SeizureCNN(n_ch=train_ds.signals[0].shape[0]).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_loader), pct_start=0.1
    )
    pos_weight = torch.tensor(args.pos_weight, device=device)

    best_auroc, best_epoch = -1.0, -1
    ckpt_path = os.path.join(out_dir, "best.pt")
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach() * y.numel()
            running[1] += y.numel()
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        val = evaluate(model, val_loader, device)
        if is_main:
            logger.info(
                "epoch %d train_loss %.4f val_loss %.4f val_auroc %.4f val_f1 %.4f (%.0fs)",
                epoch, train_loss, val["loss"], val["auroc"], val["f1"], time.time() - t0,
            )
            if val["auroc"] > best_auroc:
                best_auroc, best_epoch = val["auroc"], epoch
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": val}, ckpt_path)

    dist.barrier()
    state = torch.load(ckpt_path, map_location=device)
    model.module.load_state_dict(state["model"])
    test = evaluate(model, test_loader, device)
    if is_main:
        logger.info("best epoch %d | test auroc %.4f f1 %.4f", state["epoch"], test["auroc"], test["f1"])
        with open(os.path.join(out_dir, "test_metrics.json"), "w") as f:
            json.dump({"fold": args.fold, "best_epoch": state["epoch"], **test}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
