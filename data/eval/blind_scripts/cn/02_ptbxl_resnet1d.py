"""PTB-XL superdiagnostic classification (5 labels, multi-label) with a 1D ResNet.

PTB-XL ships a patient-wise stratified `strat_fold` (1..10). For a run we hold out
--test_fold, use the fold before it for validation, and train on the rest.

Expected layout (from our preprocess_ptbxl.py):
    {data_dir}/records500.npy   float16 [N, 5000, 12]  (10 s @ 500 Hz)
    {data_dir}/meta.csv         ecg_id, patient_id, strat_fold, NORM, MI, STTC, CD, HYP

Launch:
    torchrun --standalone --nproc_per_node=8 02_ptbxl_resnet1d.py --data_dir /data/ptbxl --test_fold 10
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = ["NORM", "MI", "STTC", "CD", "HYP"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/data/ptbxl")
    ap.add_argument("--out_dir", default="checkpoints/ptbxl")
    ap.add_argument("--test_fold", type=int, default=10, choices=range(1, 11))
    ap.add_argument("--crop", type=int, default=2500, help="random crop length (samples) for training")
    ap.add_argument("--batch_size", type=int, default=32, help="per-GPU batch")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--base_lr", type=float, default=1e-3, help="lr for a global batch of 256")
    ap.add_argument("--warmup_epochs", type=int, default=3)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class PTBXL(Dataset):
    def __init__(self, X, Y, crop=None, train=False):
        self.X, self.Y, self.crop, self.train = X, Y, crop, train

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x = self.X[i].astype(np.float32).T  # [12, T]
        if self.train and self.crop:
            s = np.random.randint(0, x.shape[1] - self.crop + 1)
            x = x[:, s:s + self.crop]
            x = x * np.random.uniform(0.9, 1.1)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(self.Y[i])


class BasicBlock1d(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv1d(cin, cout, 7, stride, 3, bias=False)
        self.b1 = nn.BatchNorm1d(cout)
        self.c2 = nn.Conv1d(cout, cout, 7, 1, 3, bias=False)
        self.b2 = nn.BatchNorm1d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        return F.relu(out + idt)


class ResNet1d(nn.Module):
    def __init__(self, n_leads=12, n_classes=5, widths=(64, 128, 196, 256)):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv1d(n_leads, widths[0], 15, 2, 7, bias=False), nn.BatchNorm1d(widths[0]), nn.ReLU(),
            nn.MaxPool1d(3, 2, 1),
        )
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock1d(cin, w, 1 if i == 0 else 2), BasicBlock1d(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin * 2, n_classes)

    def forward(self, x):
        h = self.layers(self.stem(x))
        h = torch.cat([h.mean(-1), h.amax(-1)], dim=1)
        return self.fc(h)


def load_split(data_dir, test_fold):
    meta = pd.read_csv(os.path.join(data_dir, "meta.csv"))
    X = np.load(os.path.join(data_dir, "records500.npy"), mmap_mode="r")
    Y = meta[LABELS].to_numpy(np.float32)
    val_fold = 10 if test_fold == 1 else test_fold - 1
    f = meta["strat_fold"].to_numpy()
    tr, va, te = np.where((f != test_fold) & (f != val_fold))[0], np.where(f == val_fold)[0], np.where(f == test_fold)[0]
    return (X, Y), tr, va, te


class Subset(Dataset):
    def __init__(self, base, idx):
        self.base, self.idx = base, idx

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        return self.base[self.idx[i]]


def gather_eval(tensor, n_total):
    """All-gather per-rank outputs from a non-shuffled DistributedSampler and undo its interleaving.

    DistributedSampler(shuffle=False) hands rank r the indices r, r+W, r+2W, ... after padding the
    dataset up to a multiple of W; stacking by rank and reading column-major restores the order, and
    the trailing padding samples are dropped."""
    world = dist.get_world_size()
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor)
    stacked = torch.stack(out, dim=1)  # [n_per_rank, W, ...]
    return stacked.reshape(-1, *tensor.shape[1:])[:n_total]


@torch.no_grad()
def run_eval(model, loader, device, n_total):
    model.eval()
    logits, targets = [], []
    for x, y in loader:
        # full 10 s record at eval time; the model is length agnostic thanks to global pooling
        logits.append(model(x.to(device, non_blocking=True)).float())
        targets.append(y.to(device, non_blocking=True))
    probs = gather_eval(torch.sigmoid(torch.cat(logits)), n_total).cpu().numpy()
    y = gather_eval(torch.cat(targets), n_total).cpu().numpy()
    macro_auc = roc_auc_score(y, probs, average="macro")
    f1 = f1_score(y.astype(int), (probs > 0.5).astype(int), average="macro", zero_division=0)
    return macro_auc, f1


def lr_at(epoch_float, args, peak):
    if epoch_float < args.warmup_epochs:
        return peak * epoch_float / args.warmup_epochs
    t = (epoch_float - args.warmup_epochs) / max(1, args.epochs - args.warmup_epochs)
    return peak * 0.5 * (1 + math.cos(math.pi * t))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    main_proc = rank == 0
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)  # only drives crop / scale augmentation

    (X, Y), tr, va, te = load_split(args.data_dir, args.test_fold)
    base_train, base_eval = PTBXL(X, Y, crop=args.crop, train=True), PTBXL(X, Y)
    train_set, val_set, test_set = Subset(base_train, tr), Subset(base_eval, va), Subset(base_eval, te)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(test_set, 64, sampler=test_sampler, num_workers=args.workers, pin_memory=True)

    model = ResNet1d(n_classes=len(LABELS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=1e-2)
    pos = torch.from_numpy(Y[tr].mean(0)).to(device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=((1 - pos) / pos).clamp(max=10.0))

    start_epoch, best_auc, bad_epochs = 0, 0.0, 0
    os.makedirs(args.out_dir, exist_ok=True)
    best_path = os.path.join(args.out_dir, f"resnet1d_fold{args.test_fold}_best.pt")
    last_path = os.path.join(args.out_dir, f"resnet1d_fold{args.test_fold}_last.pt")
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_auc, bad_epochs = ckpt["epoch"] + 1, ckpt["best_auc"], ckpt["bad_epochs"]

    steps = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, loss_acc = time.time(), torch.zeros((), device=device)
        for it, (x, y) in enumerate(train_loader):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(epoch + it / steps, args, peak_lr)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_acc += loss.detach()
        dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)

        val_auc, val_f1 = run_eval(model, val_loader, device, len(val_set))
        stop = torch.zeros(1, device=device)
        if main_proc:
            print(f"epoch {epoch:3d} loss {loss_acc.item() / steps:.4f} val macroAUC {val_auc:.4f} "
                  f"F1 {val_f1:.4f} [{time.time() - t0:.0f}s]", flush=True)
            if val_auc > best_auc:
                best_auc, bad_epochs = val_auc, 0
                torch.save(model.module.state_dict(), best_path + ".tmp")
                os.replace(best_path + ".tmp", best_path)
            else:
                bad_epochs += 1
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "best_auc": best_auc, "bad_epochs": bad_epochs}, last_path)
            stop[0] = float(bad_epochs >= args.patience)
        dist.broadcast(stop, src=0)
        if stop.item():
            if main_proc:
                print(f"early stopping at epoch {epoch}, best val macroAUC {best_auc:.4f}")
            break

    dist.barrier()
    model.module.load_state_dict(torch.load(best_path, map_location=device))
    test_auc, test_f1 = run_eval(model, test_loader, device, len(test_set))
    if main_proc:
        print(f"[fold {args.test_fold}] test macroAUC {test_auc:.4f} macroF1 {test_f1:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
