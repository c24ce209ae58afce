"""
PTB-XL 12-lead ECG, 5 diagnostic superclasses (NORM, MI, STTC, CD, HYP), multi-label.
Signals at 100 Hz (10 s -> 1000 samples) cached as one float16 .npy by prepare_ptbxl.py.

    torchrun --nproc_per_node=2 14_ptbxl_ecg_resnet1d.py --data_dir /data/ptbxl_cache
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["NORM", "MI", "STTC", "CD", "HYP"]


class ECGDataset(Dataset):
    def __init__(self, X, Y, train):
        self.X, self.Y, self.train = X, Y, train

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x = self.X[i].astype(np.float32).T  # (12, 1000)
        if self.train:
            x = x * np.random.uniform(0.8, 1.2) + np.random.normal(0, 0.01, x.shape).astype(np.float32)
            s = np.random.randint(0, 250)
            x = np.roll(x, -s, axis=1)
        return torch.from_numpy(x), torch.from_numpy(self.Y[i].astype(np.float32))


class BasicBlock1d(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 7, stride, 3, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, 7, 1, 3, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + idt)


class ResNet1d(nn.Module):
    def __init__(self, n_leads=12, n_classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(n_leads, 64, 15, 2, 7, bias=False), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.MaxPool1d(3, 2, 1))
        cfg = [(64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]
        blocks, cin = [], 64
        for c, s in cfg:
            blocks.append(BasicBlock1d(cin, c, s))
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(2 * cin, n_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        x = torch.cat([F.adaptive_avg_pool1d(x, 1), F.adaptive_max_pool1d(x, 1)], 1).flatten(1)
        return self.fc(x)


def load_data(data_dir):
    X = np.load(os.path.join(data_dir, "signals_100hz.npy"), mmap_mode="r")
    meta = pd.read_csv(os.path.join(data_dir, "labels.csv"))  # ecg_id, strat_fold, NORM..HYP
    Y = meta[CLASSES].values.astype(np.float32)
    folds = meta["strat_fold"].values
    # recommended split: folds 1-8 train, 9 val, 10 test
    tr, va, te = folds <= 8, folds == 9, folds == 10
    # standardise per lead with train statistics
    mu = X[tr].mean(axis=(0, 1))
    sd = X[tr].std(axis=(0, 1)) + 1e-6
    Xn = ((X - mu) / sd).astype(np.float16)
    return (Xn[tr], Y[tr]), (Xn[va], Y[va]), (Xn[te], Y[te])


def train_one_epoch(model, loader, opt, sched, device):
    model.train()
    total_loss, n_batches = 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        total_loss += loss.item()
        n_batches += 1
    stats = torch.tensor([total_loss, n_batches], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def predict(net, X, device, rank, world, bs=512):
    net.eval()
    idx = np.arange(rank, len(X), world)
    outs = []
    for s in range(0, len(idx), bs):
        xb = torch.from_numpy(X[idx[s:s + bs]].astype(np.float32).transpose(0, 2, 1)).to(device)
        outs.append(torch.sigmoid(net(xb)).cpu().numpy())
    probs = np.concatenate(outs) if outs else np.zeros((0, len(CLASSES)), np.float32)
    gathered = [None] * world
    dist.all_gather_object(gathered, (idx, probs))
    all_idx = np.concatenate([g[0] for g in gathered])
    all_p = np.concatenate([g[1] for g in gathered])
    order = np.argsort(all_idx)
    return all_p[order]


def macro_auc(Y, P):
    return float(np.mean([roc_auc_score(Y[:, k], P[:, k]) for k in range(Y.shape[1])]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/ptbxl_resnet1d")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    (Xtr, Ytr), (Xva, Yva), (Xte, Yte) = load_data(args.data_dir)
    train_ds = ECGDataset(Xtr, Ytr, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    model = ResNet1d().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(loader))

    os.makedirs(args.out, exist_ok=True)
    best_auc, history = 0.0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = train_one_epoch(model, loader, opt, sched, device)
        P = predict(model.module, Xva, device, rank, world)
        val_auc = macro_auc(Yva, P)
        if rank == 0:
            history.append({"epoch": epoch, "train_loss": train_loss, "val_macro_auc": val_auc,
                            "time": time.time() - t0})
            print(history[-1], flush=True)
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    P = predict(model.module, Xte, device, rank, world)
    if rank == 0:
        aucs = {c: roc_auc_score(Yte[:, k], P[:, k]) for k, c in enumerate(CLASSES)}
        print("test AUC per class:", {k: round(v, 4) for k, v in aucs.items()})
        print(f"test macro AUC {np.mean(list(aucs.values())):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
