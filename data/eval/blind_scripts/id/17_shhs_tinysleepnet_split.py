"""TinySleepNet-style single-channel sleep staging on SHHS-1 (C4-A1, 125 Hz -> 100 Hz).

Each night is an .npz with x: (n_epochs, 3000) and y: (n_epochs,) in 0..4
(AASM stages after merging N3/N4).  Subjects are split 80 / 10 / 10 into
train / validation / test; all epochs of one subject stay in one split.

    torchrun --nnodes=1 --nproc_per_node=8 17_shhs_tinysleepnet_split.py \
        --data /data/shhs/npz_c4a1 --out runs/tinysleep_shhs
"""
import argparse
import glob
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SleepEpochs(Dataset):
    def __init__(self, files, augment=False):
        xs, ys = [], []
        for f in files:
            d = np.load(f)
            x = d["x"].astype(np.float32)
            x = (x - x.mean()) / (x.std() + 1e-6)  # per-night normalisation
            xs.append(x)
            ys.append(d["y"].astype(np.int64))
        self.x = np.concatenate(xs)
        self.y = np.concatenate(ys)
        self.augment = augment

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment:
            x = x * np.random.uniform(0.8, 1.2) + np.random.normal(0, 0.05, x.shape).astype(np.float32)
            x = np.roll(x, np.random.randint(-150, 151))
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None], self.y[i]


class TinySleepNet(nn.Module):
    def __init__(self, fs=100, n_classes=5):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv1d(1, 128, fs // 2, fs // 4, bias=False), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
            nn.MaxPool1d(8, 8), nn.Dropout(0.5),
            nn.Conv1d(128, 128, 8, 1, padding=4, bias=False), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
            nn.Conv1d(128, 128, 8, 1, padding=4, bias=False), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
            nn.Conv1d(128, 128, 8, 1, padding=4, bias=False), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
            nn.MaxPool1d(4, 4), nn.Flatten(), nn.Dropout(0.5),
        )
        with torch.no_grad():
            n_feat = self.cnn(torch.zeros(1, 1, 30 * fs)).shape[1]
        self.fc = nn.Linear(n_feat, n_classes)

    def forward(self, x):
        return self.fc(self.cnn(x))


@torch.no_grad()
def confusion_matrix(model, loader, device, n_classes=5):
    model.eval()
    cm = torch.zeros(n_classes, n_classes, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = model(x).argmax(1)
        cm += torch.bincount(y * n_classes + p, minlength=n_classes ** 2).view(n_classes, n_classes)
    dist.all_reduce(cm)
    return cm.cpu().numpy()


def scores(cm):
    acc = np.trace(cm) / cm.sum()
    f1 = []
    for k in range(len(cm)):
        tp = cm[k, k]
        prec = tp / max(cm[:, k].sum(), 1)
        rec = tp / max(cm[k].sum(), 1)
        f1.append(0 if tp == 0 else 2 * prec * rec / (prec + rec))
    pe = (cm.sum(0) * cm.sum(1)).sum() / cm.sum() ** 2
    return acc, float(np.mean(f1)), (acc - pe) / (1 - pe)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/shhs/npz_c4a1")
    ap.add_argument("--out", default="runs/tinysleep_shhs")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # distinct augmentation streams per process
    seed_everything(args.seed + rank)

    files = sorted(glob.glob(os.path.join(args.data, "shhs1-*.npz")))
    subjects = sorted({os.path.basename(f).split(".")[0] for f in files})
    random.shuffle(subjects)
    n_val = n_test = len(subjects) // 10
    test_subj = set(subjects[:n_test])
    val_subj = set(subjects[n_test:n_test + n_val])
    train_subj = set(subjects[n_test + n_val:])

    def files_of(subj):
        return [f for f in files if os.path.basename(f).split(".")[0] in subj]

    train_ds = SleepEpochs(files_of(train_subj), augment=True)
    val_ds = SleepEpochs(files_of(val_subj))
    test_ds = SleepEpochs(files_of(test_subj))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024, num_workers=2)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=1024, num_workers=2)

    model = TinySleepNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-3)
    counts = np.bincount(train_ds.y, minlength=5)
    class_w = torch.tensor(counts.sum() / (5 * counts), dtype=torch.float32, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split.json"), "w") as f:
            json.dump({"train": sorted(train_subj), "val": sorted(val_subj), "test": sorted(test_subj)}, f)
        print(f"subjects train/val/test = {len(train_subj)}/{len(val_subj)}/{len(test_subj)}, "
              f"epochs {len(train_ds)}/{len(val_ds)}/{len(test_ds)}")

    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()

        acc, mf1, kappa = scores(confusion_matrix(model.module, val_dl, device))
        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss.item():.4f} val acc {acc:.4f} MF1 {mf1:.4f} "
                  f"kappa {kappa:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if mf1 > best_f1:
                best_f1 = mf1
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        best_f1 = max(best_f1, mf1)

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    acc, mf1, kappa = scores(confusion_matrix(model.module, test_dl, device))
    if rank == 0:
        print(f"TEST acc {acc:.4f} MF1 {mf1:.4f} kappa {kappa:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
