"""
Onera Satellite Change Detection (OSCD), 13-band Sentinel-2 pairs.
FC-Siam-diff style network with a shared encoder; activation checkpointing
in the encoder keeps 13-band 256px pairs at batch 16 per GPU in memory.

Per-band statistics are computed once (rank 0) and cached next to the data.

    torchrun --standalone --nproc_per_node=4 train_oscd.py --root /shared/OSCD --work-dir /shared/exp/oscd
"""
import argparse
import glob
import json
import os

import numpy as np
import rasterio
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

BANDS = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--patch", type=int, default=256)
    ap.add_argument("--patches-per-city", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def read_city(root, city, date):
    bands = []
    for b in BANDS:
        path = glob.glob(os.path.join(root, "images", city, f"imgs_{date}_rect", f"*{b}.tif"))[0]
        with rasterio.open(path) as src:
            bands.append(src.read(1).astype(np.float32))
    h = min(a.shape[0] for a in bands)
    w = min(a.shape[1] for a in bands)
    return np.stack([a[:h, :w] for a in bands])


def compute_band_stats(root, cities):
    s = np.zeros(len(BANDS))
    s2 = np.zeros(len(BANDS))
    n = 0
    for c in cities:
        for d in (1, 2):
            img = read_city(root, c, d).reshape(len(BANDS), -1).astype(np.float64)
            s += img.sum(1)
            s2 += (img ** 2).sum(1)
            n += img.shape[1]
    mean = s / n
    return mean.tolist(), np.sqrt(s2 / n - mean ** 2).tolist()


class OSCDPatches(Dataset):
    def __init__(self, root, cities, stats, patch, per_city, train):
        mean = np.asarray(stats["mean"], np.float32)[:, None, None]
        std = np.asarray(stats["std"], np.float32)[:, None, None]
        self.pairs, self.labels = [], []
        for c in cities:
            a = (read_city(root, c, 1) - mean) / std
            b = (read_city(root, c, 2) - mean) / std
            with rasterio.open(os.path.join(root, "labels", c, "cm", f"{c}-cm.tif")) as src:
                y = (src.read(1) > 1).astype(np.int64)
            h, w = min(a.shape[1], b.shape[1], y.shape[0]), min(a.shape[2], b.shape[2], y.shape[1])
            self.pairs.append((a[:, :h, :w], b[:, :h, :w]))
            self.labels.append(y[:h, :w])
        self.patch, self.per_city, self.train = patch, per_city, train
        # fixed grid for evaluation
        self.grid = []
        for ci, y in enumerate(self.labels):
            H, W = y.shape
            for r in range(0, max(H - patch, 0) + 1, patch):
                for c in range(0, max(W - patch, 0) + 1, patch):
                    self.grid.append((ci, r, c))

    def __len__(self):
        return len(self.pairs) * self.per_city if self.train else len(self.grid)

    def __getitem__(self, i):
        p = self.patch
        if self.train:
            ci = i % len(self.pairs)
            H, W = self.labels[ci].shape
            r, c = np.random.randint(0, max(H - p, 0) + 1), np.random.randint(0, max(W - p, 0) + 1)
        else:
            ci, r, c = self.grid[i]
        a, b = self.pairs[ci]
        a, b, y = a[:, r:r + p, c:c + p], b[:, r:r + p, c:c + p], self.labels[ci][r:r + p, c:c + p]
        if self.train:
            k = np.random.randint(4)
            a, b, y = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2)), np.rot90(y, k)
        return (torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b)),
                torch.from_numpy(np.ascontiguousarray(y)))


def conv_block(cin, cout):
    # GroupNorm: no running statistics to update twice when the block is recomputed
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(True))


class FCSiamDiff(nn.Module):
    def __init__(self, in_ch=13, widths=(32, 64, 128, 256), use_ckpt=True):
        super().__init__()
        self.enc = nn.ModuleList()
        c = in_ch
        for w in widths:
            self.enc.append(conv_block(c, w))
            c = w
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i], widths[i - 1], 2, 2) for i in range(len(widths) - 1, 0, -1)])
        self.dec = nn.ModuleList([conv_block(widths[i - 1] * 2, widths[i - 1]) for i in range(len(widths) - 1, 0, -1)])
        self.out = nn.Conv2d(widths[0], 2, 1)
        self.use_ckpt = use_ckpt

    def encode(self, x):
        feats = []
        for i, blk in enumerate(self.enc):
            if i > 0:
                x = F.max_pool2d(x, 2)
            if self.use_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
            feats.append(x)
        return feats

    def forward(self, a, b):
        fa, fb = self.encode(a), self.encode(b)
        x = torch.abs(fa[-1] - fb[-1])
        for j, (up, dec) in enumerate(zip(self.up, self.dec)):
            skip = torch.abs(fa[-2 - j] - fb[-2 - j])
            x = dec(torch.cat([up(x), skip], 1))
        return self.out(x)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.root, "images", "train.txt")) as f:
        train_cities = sorted(f.read().strip().split(","))
    with open(os.path.join(args.root, "images", "test.txt")) as f:
        test_cities = sorted(f.read().strip().split(","))

    stats_path = os.path.join(args.root, "band_stats.json")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        if not os.path.exists(stats_path):
            mean, std = compute_band_stats(args.root, train_cities)
            tmp = stats_path + f".tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"mean": mean, "std": std}, f)
            os.replace(tmp, stats_path)
    dist.barrier()
    with open(stats_path) as f:
        stats = json.load(f)

    train_ds = OSCDPatches(args.root, train_cities, stats, args.patch, args.patches_per_city, train=True)
    val_ds = OSCDPatches(args.root, test_cities, stats, args.patch, 0, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=2)

    model = FCSiamDiff(len(BANDS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.98)
    # change pixels are ~3% of OSCD
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.1, 0.9], device=device))

    ckpt_path = os.path.join(args.work_dir, "last.pth")
    start_epoch, best_f1 = 0, 0.0
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt["best_f1"]

    writer = SummaryWriter(os.path.join(args.work_dir, "tb")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for a, b, y in train_dl:
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device)
            loss = criterion(model(a, b), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        cnt = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for a, b, y in val_dl:
                a, b, y = a.to(device), b.to(device), y.to(device)
                p = model(a, b).argmax(1)
                cnt += torch.stack([((p == 1) & (y == 1)).sum(), ((p == 1) & (y == 0)).sum(),
                                    ((p == 0) & (y == 1)).sum()]).double()
        dist.all_reduce(cnt)
        dist.all_reduce(loss_acc)
        tp, fp, fn = cnt.tolist()
        prec, rec = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
        f1 = 2 * prec * rec / max(prec + rec, 1e-9)

        if rank == 0:
            writer.add_scalar("train/loss", (loss_acc[0] / loss_acc[1]).item(), epoch)
            writer.add_scalar("val/f1", f1, epoch)
            writer.add_scalar("val/precision", prec, epoch)
            writer.add_scalar("val/recall", rec, epoch)
            print(f"epoch {epoch:03d} F1 {f1:.4f} P {prec:.4f} R {rec:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best_f1": best_f1}, ckpt_path)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
