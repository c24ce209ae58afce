"""Hand-gesture classification from our EVK4 recordings with a Norse spiking CNN.

Each recording (.h5, DSEC-style event layout) holds one subject performing a
sequence of gestures; gesture segments come from <recording>.csv
(t_start_us, t_end_us, label). Train/val are split per recording so that
segments of the same take never end up on both sides.

    torchrun --nproc_per_node=4 05_evk4_gestures_norse.py --root /mnt/datasets/evk4_gestures
"""
import argparse
import csv
import glob
import os
import random

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from norse.torch import LIF, LIFParameters, LI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

H, W = 720, 1280
DS = 8  # spatial downsampling of the voxel grid
CLASSES = ["swipe_left", "swipe_right", "swipe_up", "swipe_down", "push", "pull", "rotate_cw", "rotate_ccw", "idle"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="ckpt/evk4_gestures")
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--bins", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class GestureSegments(Dataset):
    def __init__(self, recordings, bins, train):
        self.bins, self.train = bins, train
        self.items = []
        for rec in recordings:
            with open(rec.replace(".h5", ".csv")) as f:
                for row in csv.DictReader(f):
                    self.items.append((rec, int(row["t_start_us"]), int(row["t_end_us"]), CLASSES.index(row["label"])))
        self._files = {}

    def __len__(self):
        return len(self.items)

    def _h5(self, path):
        # opened lazily so every dataloader worker has its own handle
        if path not in self._files:
            self._files[path] = h5py.File(path, "r")
        return self._files[path]

    def __getitem__(self, i):
        rec, t0, t1, label = self.items[i]
        f = self._h5(rec)
        ms_to_idx = f["ms_to_idx"]
        a = int(ms_to_idx[t0 // 1000])
        b = int(ms_to_idx[min(t1 // 1000, len(ms_to_idx) - 1)])
        ev = f["events"]
        x = ev["x"][a:b].astype(np.int64) // DS
        y = ev["y"][a:b].astype(np.int64) // DS
        t = ev["t"][a:b].astype(np.int64)
        p = ev["p"][a:b].astype(np.int64)
        vox = np.zeros((self.bins, 2, H // DS, W // DS), dtype=np.float32)
        if len(t):
            tb = ((t - t0) * self.bins // max(t1 - t0, 1)).clip(0, self.bins - 1)
            np.add.at(vox, (tb, p, y, x), 1.0)
        vox = torch.from_numpy(vox)
        if self.train:
            # small random translation, sensor is mounted at a fixed pose
            dx, dy = np.random.randint(-4, 5, size=2)
            vox = torch.roll(vox, shifts=(int(dy), int(dx)), dims=(2, 3))
        return torch.clamp(vox, max=8.0) / 8.0, label


class SpikingGestureNet(nn.Module):
    def __init__(self, n_classes=len(CLASSES)):
        super().__init__()
        chans = [2, 32, 64, 128, 128]
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.lifs = nn.ModuleList()
        for cin, cout in zip(chans[:-1], chans[1:]):
            self.convs.append(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False))
            self.norms.append(nn.GroupNorm(8, cout))
            self.lifs.append(LIF(p=LIFParameters(tau_mem_inv=torch.tensor(100.0), v_th=torch.tensor(0.5),
                                                 method="super", alpha=torch.tensor(100.0))))
        self.fc = nn.Linear(128, n_classes)
        self.readout = LI()

    def forward(self, x):
        # x: [B, T, 2, h, w] -> time-major
        z = x.transpose(0, 1)
        T, B = z.shape[:2]
        for conv, norm, lif in zip(self.convs, self.norms, self.lifs):
            z = norm(conv(z.flatten(0, 1)))
            z, _ = lif(z.view(T, B, *z.shape[1:]))  # fresh state each call
        z = z.mean(dim=(3, 4))
        v, _ = self.readout(self.fc(z))
        return v.max(0).values


def run_epoch(model, loader, device, optimizer=None):
    train = optimizer is not None
    model.train(train)
    stats = torch.zeros(3, device=device)
    with torch.set_grad_enabled(train):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1 if train else 0.0)
            if train:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            stats += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)  # different augmentation stream on every rank

    recordings = sorted(glob.glob(os.path.join(args.root, "recordings", "*.h5")))
    random.shuffle(recordings)
    n_val = max(1, int(round(args.val_frac * len(recordings))))
    val_recs, train_recs = recordings[:n_val], recordings[n_val:]

    train_set = GestureSegments(train_recs, args.bins, train=True)
    val_set = GestureSegments(val_recs, args.bins, train=False)
    if rank == 0:
        print(f"{len(train_recs)} train recordings ({len(train_set)} segments), "
              f"{len(val_recs)} val recordings ({len(val_set)} segments)", flush=True)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = DDP(SpikingGestureNet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=1, pct_start=0.1)

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tr_loss, tr_acc = run_epoch(model, train_loader, device, optimizer)
        va_loss, va_acc = run_epoch(model, val_loader, device)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch:3d} | train {tr_loss:.3f} / {tr_acc:.3f} | val {va_loss:.3f} / {va_acc:.3f}",
                  flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "val_acc": va_acc,
                     "val_recordings": [os.path.basename(r) for r in val_recs]}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if va_acc > best:
                best = va_acc
                torch.save(state, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
