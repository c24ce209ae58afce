"""Target vs. non-target ERP (P300) classification, cross-subject, Brain Invaders bi2015a.

Epochs were extracted with MOABB/MNE (0-1 s after each flash, 32 electrodes, band-pass
1-20 Hz, resampled to 128 Hz) and saved per subject:
    {data_dir}/sub-{id:02d}.npz   X [n_epochs, 32, 128] float32, y [n_epochs] (1 = target)
Targets make up 1/6 of the epochs.

Subject-wise k-fold; --fold selects the held-out subjects.

    torchrun --nproc_per_node=4 15_p300_erp_cnn.py --data_dir /data/bi2015a_epochs --fold 0
"""
import argparse
import glob
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--output_dir", type=str, default="./output/p300")
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--num_folds", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=1e-4)
    parser.add_argument("--patience", type=int, default=8)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_subjects(files):
    X, y = [], []
    for f in files:
        d = np.load(f)
        x = d["X"].astype(np.float32)
        # per-subject, per-channel standardisation
        x = (x - x.mean(axis=(0, 2), keepdims=True)) / (x.std(axis=(0, 2), keepdims=True) + 1e-6)
        X.append(x)
        y.append(d["y"].astype(np.int64))
    return TensorDataset(torch.from_numpy(np.concatenate(X)), torch.from_numpy(np.concatenate(y)))


class ERPNet(nn.Module):
    """Spatial filtering first (like xDAWN), then temporal convolutions."""

    def __init__(self, n_ch=32, n_spatial=16, n_classes=2):
        super().__init__()
        self.spatial = nn.Sequential(nn.Conv1d(n_ch, n_spatial, 1, bias=False), nn.BatchNorm1d(n_spatial))
        self.temporal = nn.Sequential(
            nn.Conv1d(n_spatial, 32, 9, padding=4), nn.BatchNorm1d(32), nn.ELU(), nn.AvgPool1d(2),
            nn.Conv1d(32, 64, 7, padding=3), nn.BatchNorm1d(64), nn.ELU(), nn.AvgPool1d(2),
            nn.Conv1d(64, 64, 5, padding=2), nn.BatchNorm1d(64), nn.ELU(), nn.AvgPool1d(2),
            nn.Dropout(0.4),
        )
        self.fc = nn.Linear(64 * 16, n_classes)

    def forward(self, x):
        return self.fc(self.temporal(self.spatial(x)).flatten(1))


@torch.no_grad()
def evaluate(model, loader, num_examples, device):
    model.eval()
    scores, targets = [], []
    for x, y in loader:
        scores.append(F.softmax(model(x.to(device)), dim=1)[:, 1])
        targets.append(y.to(device))
    scores, targets = torch.cat(scores), torch.cat(targets)
    world_size = dist.get_world_size()
    all_scores = [torch.zeros_like(scores) for _ in range(world_size)]
    all_targets = [torch.zeros_like(targets) for _ in range(world_size)]
    dist.all_gather(all_scores, scores)
    dist.all_gather(all_targets, targets)
    s = torch.stack(all_scores, dim=1).view(-1)[:num_examples].cpu().numpy()
    t = torch.stack(all_targets, dim=1).view(-1)[:num_examples].cpu().numpy()
    pred = (s > 0.5).astype(int)
    return {"auroc": float(roc_auc_score(t, s)), "bacc": float(balanced_accuracy_score(t, pred)),
            "f1": float(f1_score(t, pred))}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    seed_everything(args.seed)

    files = np.array(sorted(glob.glob(os.path.join(args.data_dir, "sub-*.npz"))))
    kfold = KFold(n_splits=args.num_folds, shuffle=True, random_state=args.seed)
    train_val_idx, test_idx = list(kfold.split(files))[args.fold]
    rng = np.random.RandomState(args.seed)
    val_idx = rng.choice(train_val_idx, size=max(1, len(train_val_idx) // 8), replace=False)
    train_idx = np.setdiff1d(train_val_idx, val_idx)

    train_ds = load_subjects(files[train_idx])
    val_ds = load_subjects(files[val_idx])
    test_ds = load_subjects(files[test_idx])

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1024, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.num_workers, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=1024, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.num_workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ERPNet()).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    n_pos = int(train_ds.tensors[1].sum())
    n_neg = len(train_ds) - n_pos
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, n_neg / n_pos], device=device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"subjects train/val/test: {len(train_idx)}/{len(val_idx)}/{len(test_idx)}; "
              f"epochs train {len(train_ds)} ({n_pos} targets)")
    best_auc, patience_left = 0.0, args.patience
    best_path = os.path.join(args.output_dir, f"erpnet_fold{args.fold}.pt")
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(1, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step(epoch + i / len(train_loader))
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (dist.get_world_size() * len(train_loader))

        metrics = evaluate(model, val_loader, len(val_ds), device)
        history.append({"epoch": epoch, "train_loss": train_loss, **metrics})
        if rank == 0:
            print(f"epoch {epoch:02d} | loss {train_loss:.4f} | val AUROC {metrics['auroc']:.4f} "
                  f"bACC {metrics['bacc']:.4f} F1 {metrics['f1']:.4f}", flush=True)
        if metrics["auroc"] > best_auc:
            best_auc, patience_left = metrics["auroc"], args.patience
            if rank == 0:
                torch.save(model.module.state_dict(), best_path)
        else:
            patience_left -= 1
            if patience_left == 0:
                break

    dist.barrier()
    model.module.load_state_dict(torch.load(best_path, map_location=device))
    test_metrics = evaluate(model, test_loader, len(test_ds), device)
    if rank == 0:
        print(f"fold {args.fold} TEST AUROC {test_metrics['auroc']:.4f} bACC {test_metrics['bacc']:.4f} "
              f"F1 {test_metrics['f1']:.4f}")
        with open(os.path.join(args.output_dir, f"fold{args.fold}_results.json"), "w") as f:
            json.dump({"history": history, "test": test_metrics}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
