"""Heatmap-based particle picker for cryo-EM micrographs (CenterNet-like).

Coordinates come from per-micrograph .box files (EMAN2 / crYOLO format).  The network
predicts a Gaussian heatmap at 1/4 resolution; picks are local maxima above a threshold.
Validation matches picks to ground truth within a radius and reports precision / recall / F1.

    torchrun --nproc_per_node=4 12_particle_picker_heatmap.py --mics /data/empiar10017/mics \
        --boxes /data/empiar10017/boxes --box-size 180 --out runs/picker_10017
"""
import argparse
import glob
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

STRIDE = 4


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mics", required=True)
    p.add_argument("--boxes", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--box-size", type=int, required=True)
    p.add_argument("--downsample", type=int, default=4)
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--thresh", type=float, default=0.3)
    p.add_argument("--n-val", type=int, default=40)
    return p.parse_args()


def read_box(path, box_size):
    if not os.path.exists(path):
        return np.zeros((0, 2), np.float32)
    a = np.loadtxt(path, ndmin=2)
    return (a[:, :2] + box_size / 2).astype(np.float32)  # lower-left corner -> centre (x, y)


def load_mic(path, ds):
    with mrcfile.open(path, permissive=True) as m:
        img = torch.from_numpy(m.data.astype(np.float32))[None, None]
    img = F.avg_pool2d(img, ds)[0, 0].numpy()
    img = (img - np.median(img)) / (img.std() + 1e-6)
    return np.clip(img, -4, 4)


class MicDataset(Dataset):
    def __init__(self, mic_files, box_dir, box_size, ds, crop, train):
        self.items = []
        for f in mic_files:
            name = os.path.splitext(os.path.basename(f))[0]
            coords = read_box(os.path.join(box_dir, name + ".box"), box_size) / ds
            self.items.append((load_mic(f, ds), coords))
        self.sigma = box_size / ds / STRIDE / 6
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def heatmap(self, coords, h, w):
        hm = np.zeros((h // STRIDE, w // STRIDE), np.float32)
        yy, xx = np.mgrid[0:h // STRIDE, 0:w // STRIDE]
        r = int(3 * self.sigma) + 1
        for x, y in (coords / STRIDE).astype(int):
            y0, y1, x0, x1 = max(y - r, 0), y + r + 1, max(x - r, 0), x + r + 1
            g = np.exp(-((yy[y0:y1, x0:x1] - y) ** 2 + (xx[y0:y1, x0:x1] - x) ** 2) / (2 * self.sigma ** 2))
            hm[y0:y1, x0:x1] = np.maximum(hm[y0:y1, x0:x1], g)
        return hm

    def __getitem__(self, i):
        img, coords = self.items[i]
        h, w = img.shape
        if self.train:
            c = self.crop
            y0, x0 = np.random.randint(0, h - c + 1), np.random.randint(0, w - c + 1)
            img = img[y0:y0 + c, x0:x0 + c]
            coords = coords - np.array([x0, y0], np.float32)
            keep = (coords[:, 0] >= 0) & (coords[:, 0] < c) & (coords[:, 1] >= 0) & (coords[:, 1] < c)
            coords = coords[keep]
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                coords = np.stack([c - 1 - coords[:, 0], coords[:, 1]], 1)
            h = w = c
        else:
            h, w = (h // 32) * 32, (w // 32) * 32
            img = img[:h, :w]
            coords = coords[(coords[:, 0] < w) & (coords[:, 1] < h)]
        hm = self.heatmap(coords, h, w)
        return torch.from_numpy(img.copy())[None], torch.from_numpy(hm)[None], i


class Picker(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights=None)
        r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)                  # /2
        self.l1, self.l2, self.l3 = r.layer1, r.layer2, r.layer3           # /2, /4, /8, /16 with maxpool
        self.pool = r.maxpool
        self.lat3 = nn.Conv2d(256, 128, 1)
        self.lat2 = nn.Conv2d(128, 128, 1)
        self.lat1 = nn.Conv2d(64, 128, 1)
        self.head = nn.Sequential(nn.Conv2d(128, 64, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(64, 1, 1))
        nn.init.constant_(self.head[-1].bias, -2.19)

    def forward(self, x):
        c1 = self.l1(self.pool(self.stem(x)))   # /4
        c2 = self.l2(c1)                         # /8
        c3 = self.l3(c2)                         # /16
        p = self.lat3(c3)
        p = F.interpolate(p, size=c2.shape[-2:], mode="nearest") + self.lat2(c2)
        p = F.interpolate(p, size=c1.shape[-2:], mode="nearest") + self.lat1(c1)
        return self.head(p)


def focal_heatmap_loss(logits, target, alpha=2, beta=4):
    p = torch.sigmoid(logits).clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    neg = 1 - pos
    pos_loss = -(torch.log(p) * (1 - p) ** alpha * pos).sum()
    neg_loss = -(torch.log(1 - p) * p ** alpha * (1 - target) ** beta * neg).sum()
    return (pos_loss + neg_loss) / pos.sum().clamp(min=1)


def extract_peaks(hm, thresh):
    mx = F.max_pool2d(hm, 5, 1, 2)
    peaks = (hm == mx) & (hm > thresh)
    yx = peaks[0, 0].nonzero().float()
    return (yx[:, [1, 0]] * STRIDE).cpu().numpy()


def match(pred, gt, radius):
    if len(pred) == 0 or len(gt) == 0:
        return 0, len(pred), len(gt)
    d = cdist(pred, gt)
    r, c = linear_sum_assignment(d)
    tp = int((d[r, c] <= radius).sum())
    return tp, len(pred) - tp, len(gt) - tp


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    mics = sorted(glob.glob(os.path.join(args.mics, "*.mrc")))
    train_files, val_files = mics[:-args.n_val], mics[-args.n_val:]
    train_ds = MicDataset(train_files, args.boxes, args.box_size, args.downsample, args.crop, True)
    val_ds = MicDataset(val_files, args.boxes, args.box_size, args.downsample, args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=2)
    radius = 0.5 * args.box_size / args.downsample

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Picker()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[40, 52], gamma=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, hm, _ in train_dl:
            img, hm = img.to(device, non_blocking=True), hm.to(device, non_blocking=True)
            loss = focal_heatmap_loss(model(img), hm)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        tp = fp = fn = 0
        with torch.no_grad():
            for img, _, idx in val_dl:
                pred_hm = torch.sigmoid(model.module(img.to(device)))
                picks = extract_peaks(pred_hm, args.thresh)
                gt = val_ds.items[int(idx)][1]
                gt = gt[(gt[:, 0] < img.shape[-1]) & (gt[:, 1] < img.shape[-2])]
                a, b, c = match(picks, gt, radius)
                tp, fp, fn = tp + a, fp + b, fn + c
        counts = torch.tensor([tp, fp, fn], dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        tp, fp, fn = counts.tolist()
        prec = tp / max(tp + fp, 1)
        rec = tp / max(tp + fn, 1)
        f1 = 2 * prec * rec / max(prec + rec, 1e-8)

        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss.item():.4f} P {prec:.3f} R {rec:.3f} F1 {f1:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "f1": f1,
                     "box_size": args.box_size, "downsample": args.downsample}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if f1 > best_f1:
                best_f1 = f1
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
