#!/usr/bin/env python3
"""Gated attention MIL (Ilse et al. 2018) on pre-extracted patch features, k-fold CV.

Features come from the CLAM extraction step: <feat_dir>/pt_files/<slide_id>.pt, each an
[N, 1024] tensor of ResNet50-trunc features.  One slide (bag) per step.
Splits are the patient-level splits written by create_splits_seq.py (splits_{k}.csv).
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("abmil")

LABELS = {"normal": 0, "tumor": 1}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True, help="slide-level csv: case_id, slide_id, label")
    p.add_argument("--feat_dir", required=True)
    p.add_argument("--split_dir", required=True, help="directory with splits_{k}.csv")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--out_dir", default="results/abmil_c16")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--in_dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.25)
    p.add_argument("--n_classes", type=int, default=2)
    p.add_argument("--max_patches", type=int, default=16000,
                   help="randomly subsample very large bags during training")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class SlideBags(Dataset):
    def __init__(self, df, feat_dir, max_patches=None, train=False):
        self.slide_ids = df["slide_id"].tolist()
        self.labels = df["label"].map(LABELS).astype(int).tolist()
        self.feat_dir = feat_dir
        self.max_patches = max_patches
        self.train = train

    def __len__(self):
        return len(self.slide_ids)

    def __getitem__(self, idx):
        sid = self.slide_ids[idx]
        feats = torch.load(os.path.join(self.feat_dir, "pt_files", f"{sid}.pt"), map_location="cpu")
        if self.train and self.max_patches and feats.shape[0] > self.max_patches:
            keep = torch.randperm(feats.shape[0])[: self.max_patches]
            feats = feats[keep]
        return feats.float(), self.labels[idx], sid


class GatedABMIL(nn.Module):
    def __init__(self, in_dim=1024, hidden=256, n_classes=2, dropout=0.25):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU(), nn.Dropout(dropout))
        self.attn_a = nn.Sequential(nn.Linear(512, hidden), nn.Tanh(), nn.Dropout(dropout))
        self.attn_b = nn.Sequential(nn.Linear(512, hidden), nn.Sigmoid(), nn.Dropout(dropout))
        self.attn_c = nn.Linear(hidden, 1)
        self.classifier = nn.Linear(512, n_classes)

    def forward(self, x):
        h = self.fc(x)                                   # N x 512
        a = self.attn_c(self.attn_a(h) * self.attn_b(h))  # N x 1
        a = torch.softmax(a.transpose(0, 1), dim=1)       # 1 x N
        m = a @ h                                        # 1 x 512
        return self.classifier(m), a


def train_one_epoch(model, loader, optimizer, device):
    model.train()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for feats, label, _ in loader:
        feats = feats.squeeze(0).to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        logits, _ = model(feats)
        loss = F.cross_entropy(logits, label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        stats[0] += loss.detach()
        stats[1] += (logits.argmax(1) == label).sum()
        stats[2] += 1
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, labels = [], []
    for feats, label, _ in loader:
        feats = feats.squeeze(0).to(device, non_blocking=True)
        logits, _ = model(feats)
        probs.append(torch.softmax(logits, dim=1)[0, 1].item())
        labels.append(int(label))
    probs, labels = np.asarray(probs), np.asarray(labels)
    auc = roc_auc_score(labels, probs) if len(np.unique(labels)) > 1 else float("nan")
    bacc = balanced_accuracy_score(labels, (probs > 0.5).astype(int))
    return auc, bacc


def make_loader(ds, sampler, workers):
    return DataLoader(ds, batch_size=1, sampler=sampler, num_workers=workers,
                      pin_memory=True, persistent_workers=workers > 0)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()

    df = pd.read_csv(args.csv)
    fold_results = []
    for fold in range(args.folds):
        split = pd.read_csv(os.path.join(args.split_dir, f"splits_{fold}.csv"))

        def subset(col):
            ids = set(split[col].dropna())
            return df[df["slide_id"].isin(ids)].reset_index(drop=True)

        train_ds = SlideBags(subset("train"), args.feat_dir, args.max_patches, train=True)
        val_ds = SlideBags(subset("val"), args.feat_dir)
        test_ds = SlideBags(subset("test"), args.feat_dir)
        logger.info("fold %d: %d train / %d val / %d test slides", fold, len(train_ds), len(val_ds), len(test_ds))

        train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        train_loader = make_loader(train_ds, train_sampler, args.workers)
        val_loader = make_loader(val_ds, DistributedSampler(val_ds, shuffle=False), args.workers)
        test_loader = make_loader(test_ds, DistributedSampler(test_ds, shuffle=False), args.workers)

        model = GatedABMIL(args.in_dim, args.hidden, args.n_classes, args.dropout).to(device)
        model = DDP(model, device_ids=[local_rank])
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
        scheduler = CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)

        best_auc = -1.0
        best_path = os.path.join(args.out_dir, f"s_{fold}_checkpoint.pt")
        for epoch in range(args.epochs):
            t0 = time.time()
            train_sampler.set_epoch(epoch)
            tr_loss, tr_acc = train_one_epoch(model, train_loader, optimizer, device)
            scheduler.step()
            val_auc, val_bacc = evaluate(model.module, val_loader, device)
            if rank == 0:
                logger.info("fold %d epoch %03d  loss %.4f acc %.3f | val auc %.4f bacc %.3f  (%.0fs)",
                            fold, epoch, tr_loss, tr_acc, val_auc, val_bacc, time.time() - t0)
                if val_auc > best_auc:
                    best_auc = val_auc
                    torch.save(model.module.state_dict(), best_path)
            dist.barrier()

        model.module.load_state_dict(torch.load(best_path, map_location=device))
        test_auc, test_bacc = evaluate(model.module, test_loader, device)
        if rank == 0:
            logger.info("fold %d  best val auc %.4f  test auc %.4f  bacc %.3f", fold, best_auc, test_auc, test_bacc)
            fold_results.append({"fold": fold, "val_auc": best_auc, "test_auc": test_auc, "test_bacc": test_bacc})
        del model, optimizer

    if rank == 0:
        res = pd.DataFrame(fold_results)
        res.to_csv(os.path.join(args.out_dir, "summary.csv"), index=False)
        logger.info("test auc %.4f +- %.4f", res.test_auc.mean(), res.test_auc.std())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
