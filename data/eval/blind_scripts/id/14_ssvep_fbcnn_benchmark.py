"""Filter-bank CNN for 40-target SSVEP classification (Tsinghua Benchmark dataset).

Data: S1.mat .. S35.mat, `data` of shape (64 ch, 1500 samples, 40 targets, 6
blocks) at 250 Hz.  We use the 9 occipital channels, a 0.5 s visual latency
offset and `--win` seconds of signal, decomposed into `--n_bands` sub-bands.
Cross-block validation: block `--test_block` of every subject is held out.

    torchrun --nproc_per_node=4 14_ssvep_fbcnn_benchmark.py --win 1.0
"""
import argparse
import math
import os

import numpy as np
import scipy.io as sio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.signal import cheby1, filtfilt
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

FS = 250
OCCIPITAL = [47, 53, 54, 55, 56, 57, 60, 61, 62]  # Pz, PO5, PO3, POz, PO4, PO6, O1, Oz, O2 (0-based)
LATENCY = int(0.5 * FS) + int(0.14 * FS)


def filter_bank(x, n_bands):
    """x: (..., T) -> (..., n_bands, T) with Chebyshev type-I band-pass filters."""
    out = []
    for b in range(1, n_bands + 1):
        lo, hi = 8 * b, 90
        bb, aa = cheby1(4, 1, [lo / (FS / 2), hi / (FS / 2)], btype="band")
        out.append(filtfilt(bb, aa, x, axis=-1))
    return np.stack(out, axis=-2).astype(np.float32)


def load_benchmark(root, subjects, win, n_bands):
    n = int(win * FS)
    X, y, blk = [], [], []
    for s in subjects:
        data = sio.loadmat(os.path.join(root, f"S{s}.mat"))["data"][OCCIPITAL]
        seg = data[:, LATENCY:LATENCY + n]                          # (9, n, 40, 6)
        seg = np.transpose(seg, (3, 2, 0, 1)).reshape(-1, len(OCCIPITAL), n)   # (6*40, 9, n)
        fb = filter_bank(seg, n_bands)                              # (240, 9, bands, n)
        X.append(np.transpose(fb, (0, 2, 1, 3)))                    # (240, bands, 9, n)
        y.append(np.tile(np.arange(40), 6))
        blk.append(np.repeat(np.arange(6), 40))
    return np.concatenate(X), np.concatenate(y).astype(np.int64), np.concatenate(blk)


class FBCNN(nn.Module):
    def __init__(self, n_bands, n_chans, n_times, n_classes=40, f=120, drop=0.5):
        super().__init__()
        self.band_weights = nn.Conv2d(n_bands, 1, 1, bias=False)
        nn.init.constant_(self.band_weights.weight, 1.0 / n_bands)
        self.spatial = nn.Conv2d(1, f, (n_chans, 1))
        self.temporal = nn.Conv2d(f, f, (1, 2), stride=(1, 2))
        self.conv3 = nn.Conv2d(f, f, (1, 10), padding=(0, 4))
        self.drop = nn.Dropout(drop)
        with torch.no_grad():
            n_feat = self._features(torch.zeros(1, n_bands, n_chans, n_times)).shape[1]
        self.fc = nn.Linear(n_feat, n_classes)

    def _features(self, x):
        x = self.band_weights(x)
        x = self.drop(F.relu(self.spatial(x)))
        x = self.drop(F.relu(self.temporal(x)))
        x = self.drop(F.relu(self.conv3(x)))
        return x.flatten(1)

    def forward(self, x):
        return self.fc(self._features(x))


def itr_bits_per_min(acc, n_targets, seconds):
    if acc <= 1.0 / n_targets:
        return 0.0
    bits = math.log2(n_targets) + acc * math.log2(acc)
    if acc < 1.0:
        bits += (1 - acc) * math.log2((1 - acc) / (n_targets - 1))
    return bits * 60.0 / seconds


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        pred = model(x.to(device, non_blocking=True)).argmax(1).cpu()
        correct += (pred == y).sum().item()
        total += y.numel()
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ssvep_benchmark")
    ap.add_argument("--subjects", type=int, nargs="+", default=list(range(1, 36)))
    ap.add_argument("--win", type=float, default=1.0)
    ap.add_argument("--n_bands", type=int, default=3)
    ap.add_argument("--test_block", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="ckpt/fbcnn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2021)

    X, y, blk = load_benchmark(args.root, args.subjects, args.win, args.n_bands)
    tr, te = blk != args.test_block, blk == args.test_block
    train_ds = TensorDataset(torch.from_numpy(X[tr]), torch.from_numpy(y[tr]))
    test_ds = TensorDataset(torch.from_numpy(X[te]), torch.from_numpy(y[te]))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, pin_memory=True, drop_last=True)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=512, shuffle=False,
                         pin_memory=True)

    model = FBCNN(args.n_bands, len(OCCIPITAL), X.shape[-1]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(0.6 * args.epochs), int(0.85 * args.epochs)])
    gaze_shift = 0.5  # seconds between trials in the online speller

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train / {len(test_ds)} test trials, input {tuple(X.shape[1:])}, {world} GPUs")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, yb in train_dl:
            x, yb = x.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), yb, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        if epoch % 25 == 24 or epoch == args.epochs - 1:
            acc = evaluate(model.module, test_dl, device)
            if rank == 0:
                itr = itr_bits_per_min(acc, 40, args.win + gaze_shift)
                print(f"epoch {epoch + 1}: loss {loss.item():.4f} test acc {acc:.4f} ITR {itr:.1f} bits/min", flush=True)
                if acc > best:
                    best = acc
                    torch.save({"model": model.module.state_dict(), "args": vars(args), "acc": acc},
                               os.path.join(args.out, f"fbcnn_win{args.win}_blk{args.test_block}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
