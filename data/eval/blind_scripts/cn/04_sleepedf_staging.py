"""Sleep staging (W, N1, N2, N3, REM) on Sleep-EDF-78 (SC subset), single-channel Fpz-Cz.

Each subject's nights were epoched into 30 s windows by prepare_sleepedf.py:
    {data_dir}/SC4{subject:02d}*.npz  with x [n_epochs, 3000] float32 (100 Hz), y [n_epochs] int (0..4)

The classifier sees the target epoch plus --context neighbours on each side.
Subject-wise k-fold: both nights of a subject always stay in the same split.

    torchrun --nproc_per_node=4 04_sleepedf_staging.py --data_dir /data/sleepedf/sc_npz --fold 3
"""
import argparse
import glob
import logging
import os
import random
import re
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import cohen_kappa_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STAGES = ["W", "N1", "N2", "N3", "REM"]
log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--save_dir", default="./ckpt_sleepedf")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=10)
    p.add_argument("--val_subjects", type=int, default=4)
    p.add_argument("--context", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--patience", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class NightDataset(Dataset):
    """One recording night; item i is epoch i with `context` neighbours on each side."""

    def __init__(self, path, context):
        d = np.load(path)
        x = d["x"].astype(np.float32)
        self.x = (x - x.mean()) / (x.std() + 1e-6)
        self.y = d["y"].astype(np.int64)
        self.context = context
        self.valid = np.arange(context, len(self.y) - context)

    def __len__(self):
        return len(self.valid)

    def __getitem__(self, i):
        c = self.valid[i]
        seq = self.x[c - self.context:c + self.context + 1].reshape(1, -1)
        return torch.from_numpy(seq), int(self.y[c])


def subject_of(path):
    # SC4ssN: ss = subject number, N = night
    return int(re.search(r"SC4(\d\d)", os.path.basename(path)).group(1))


def make_folds(data_dir, n_folds, fold, n_val):
    by_subject = defaultdict(list)
    for f in sorted(glob.glob(os.path.join(data_dir, "SC4*.npz"))):
        by_subject[subject_of(f)].append(f)
    subjects = np.random.permutation(sorted(by_subject))
    folds = np.array_split(subjects, n_folds)
    test = folds[fold]
    rest = np.concatenate([f for i, f in enumerate(folds) if i != fold])
    val, train = rest[:n_val], rest[n_val:]
    files = lambda subs: [f for s in subs for f in by_subject[s]]
    return files(train), files(val), files(test)


class SleepCNN(nn.Module):
    """Two-branch CNN (small / large filters) in the spirit of DeepSleepNet's feature extractor."""

    def __init__(self, n_classes=5, fs=100):
        super().__init__()

        def branch(k, stride, pool1, pool2, k2):
            return nn.Sequential(
                nn.Conv1d(1, 64, k, stride, k // 2, bias=False), nn.BatchNorm1d(64), nn.ReLU(),
                nn.MaxPool1d(pool1), nn.Dropout(0.5),
                nn.Conv1d(64, 128, k2, 1, k2 // 2, bias=False), nn.BatchNorm1d(128), nn.ReLU(),
                nn.Conv1d(128, 128, k2, 1, k2 // 2, bias=False), nn.BatchNorm1d(128), nn.ReLU(),
                nn.MaxPool1d(pool2), nn.AdaptiveAvgPool1d(8),
            )

        self.small = branch(fs // 2, fs // 16, 8, 4, 7)
        self.large = branch(fs * 4, fs // 2, 4, 2, 5)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2 * 128 * 8, n_classes)

    def forward(self, x):
        h = torch.cat([self.small(x).flatten(1), self.large(x).flatten(1)], dim=1)
        return self.fc(self.dropout(h))


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    preds, ys = [], []
    for x, y in loader:
        preds.append(model(x.to(device, non_blocking=True)).argmax(1))
        ys.append(y.to(device, non_blocking=True))
    preds, ys = torch.cat(preds), torch.cat(ys)
    ws = dist.get_world_size()
    gp, gy = [torch.zeros_like(preds) for _ in range(ws)], [torch.zeros_like(ys) for _ in range(ws)]
    dist.all_gather(gp, preds)
    dist.all_gather(gy, ys)
    p = torch.stack(gp, 1).reshape(-1)[:n_total].cpu().numpy()
    y = torch.stack(gy, 1).reshape(-1)[:n_total].cpu().numpy()
    return {
        "acc": float((p == y).mean()),
        "mf1": float(f1_score(y, p, average="macro")),
        "kappa": float(cohen_kappa_score(y, p)),
        "per_class_f1": f1_score(y, p, average=None, labels=range(5)).round(3).tolist(),
    }


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout masks / shuffles per process
    set_seed(args.seed + rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    train_f, val_f, test_f = make_folds(args.data_dir, args.n_folds, args.fold, args.val_subjects)
    log.info("fold %d: %d train / %d val / %d test nights", args.fold, len(train_f), len(val_f), len(test_f))
    train_ds = ConcatDataset([NightDataset(f, args.context) for f in train_f])
    val_ds = ConcatDataset([NightDataset(f, args.context) for f in val_f])
    test_ds = ConcatDataset([NightDataset(f, args.context) for f in test_f])

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    # inverse-frequency class weights (N1 is rare)
    y_train = np.concatenate([d.y[d.valid] for d in train_ds.datasets])
    counts = np.bincount(y_train, minlength=5).astype(np.float64)
    counts_t = torch.tensor(counts, device=device)
    weights = (counts_t.sum() / (5 * counts_t.clamp(min=1))).float()

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SleepCNN()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)

    os.makedirs(args.save_dir, exist_ok=True)
    best_path = os.path.join(args.save_dir, f"sleepcnn_fold{args.fold}.pt")
    best_mf1, wait = -1.0, 0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y, weight=weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(tot)

        m = evaluate(model, val_loader, device, len(val_ds))
        scheduler.step(m["mf1"])
        log.info("epoch %02d loss %.4f | val acc %.4f MF1 %.4f kappa %.4f %s",
                 epoch, (tot[0] / tot[1]).item(), m["acc"], m["mf1"], m["kappa"], m["per_class_f1"])
        if m["mf1"] > best_mf1:
            best_mf1, wait = m["mf1"], 0
            if rank == 0:
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "val": m}, best_path)
        else:
            wait += 1
            if wait >= args.patience:
                log.info("no improvement for %d epochs, stopping", args.patience)
                break

    dist.barrier()
    ck = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ck["state_dict"])
    m = evaluate(model, test_loader, device, len(test_ds))
    log.info("TEST fold %d (best epoch %d): acc %.4f MF1 %.4f kappa %.4f %s",
             args.fold, ck["epoch"], m["acc"], m["mf1"], m["kappa"], m["per_class_f1"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
