"""Multi-column CNN for crowd counting on UCF-QNRF (images pre-resized so the long side is <= 2048).

Density targets are rendered on the fly at 1/4 resolution: one normalised Gaussian
(sigma in target pixels) per annotated head.

    torchrun --nproc_per_node=4 07_mcnn_ucf_qnrf.py --data /data/UCF-QNRF_ECCV18_1536
"""
import argparse
import os
import random
import time
from glob import glob

import numpy as np
import scipy.io as sio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms.functional as TF


def get_parser():
    parser = argparse.ArgumentParser("MCNN UCF-QNRF")
    parser.add_argument("--data", required=True)
    parser.add_argument("--ckpt-dir", default="checkpoints/mcnn_qnrf")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--crop", type=int, default=384)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sigma", type=float, default=2.0)
    parser.add_argument("--eval-freq", type=int, default=5)
    parser.add_argument("--workers", type=int, default=6)
    return parser


def render_density(points, h, w, sigma, down=4):
    """Sum of unit-mass Gaussians at `points` (full-res xy) on an (h/down, w/down) grid."""
    th, tw = h // down, w // down
    den = np.zeros((th, tw), np.float32)
    r = int(3 * sigma)
    ax = np.arange(-r, r + 1, dtype=np.float32)
    for x, y in points:
        cx, cy = x / down, y / down
        ix, iy = int(cx), int(cy)
        if not (0 <= ix < tw and 0 <= iy < th):
            continue
        gx = np.exp(-((ax + ix - cx) ** 2) / (2 * sigma ** 2))
        gy = np.exp(-((ax + iy - cy) ** 2) / (2 * sigma ** 2))
        k = np.outer(gy, gx)
        k /= k.sum()
        x0, x1 = max(ix - r, 0), min(ix + r + 1, tw)
        y0, y1 = max(iy - r, 0), min(iy + r + 1, th)
        den[y0:y1, x0:x1] += k[y0 - (iy - r):y1 - (iy - r), x0 - (ix - r):x1 - (ix - r)]
    return den


class QNRF(Dataset):
    def __init__(self, root, split, crop, sigma, train):
        self.files = sorted(glob(os.path.join(root, split, "*.jpg")))
        self.crop, self.sigma, self.train = crop, sigma, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        pts = sio.loadmat(self.files[i].replace(".jpg", "_ann.mat"))["annPoints"].astype(np.float32)
        w, h = img.size
        if self.train:
            x0 = random.randint(0, max(w - self.crop, 0))
            y0 = random.randint(0, max(h - self.crop, 0))
            img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))  # pads with black if image is small
            pts = pts - np.array([x0, y0], np.float32)
            keep = (pts[:, 0] >= 0) & (pts[:, 0] < self.crop) & (pts[:, 1] >= 0) & (pts[:, 1] < self.crop)
            pts = pts[keep]
            w = h = self.crop
            if random.random() < 0.5:
                img = TF.hflip(img)
                pts[:, 0] = w - 1 - pts[:, 0]
        else:
            w, h = w // 16 * 16, h // 16 * 16
            img = img.crop((0, 0, w, h))
        x = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        den = torch.from_numpy(render_density(pts, h, w, self.sigma))[None]
        return x, den, float(len(pts))


def column(c1, c2, k1, k2):
    return nn.Sequential(
        nn.Conv2d(3, c1, k1, padding=k1 // 2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, k2, padding=k2 // 2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(c2, c1, k2, padding=k2 // 2), nn.ReLU(inplace=True),
        nn.Conv2d(c1, c1 // 2, k2, padding=k2 // 2), nn.ReLU(inplace=True),
    )


class MCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.branch1 = column(16, 32, 9, 7)
        self.branch2 = column(20, 40, 7, 5)
        self.branch3 = column(24, 48, 5, 3)
        self.fuse = nn.Conv2d(8 + 10 + 12, 1, 1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.fuse(torch.cat([self.branch1(x), self.branch2(x), self.branch3(x)], 1))


def reduce_tensor(t):
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)
    for x, _, count in loader:
        pred = model(x.to(device)).sum()
        err = pred - count.to(device).float().squeeze()
        sums += torch.stack([err.abs(), err * err, torch.ones_like(err)])
    sums = reduce_tensor(sums)
    return (sums[0] / sums[2]).item(), torch.sqrt(sums[1] / sums[2]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    train_set = QNRF(args.data, "Train", args.crop, args.sigma, train=True)
    val_set = QNRF(args.data, "Test", args.crop, args.sigma, train=False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 1, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = DDP(MCNN().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best_mae = 1e9
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for x, den, _ in train_loader:
            x, den = x.to(device, non_blocking=True), den.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), den, reduction="sum") / x.size(0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += torch.stack([loss.detach(), torch.ones_like(loss)])
        epoch_loss = reduce_tensor(epoch_loss)
        if rank == 0:
            print(f"[{epoch:03d}] loss {epoch_loss[0] / epoch_loss[1]:.4f} time {time.time() - start:.0f}s", flush=True)

        if rank == 0 and (epoch + 1) % args.eval_freq == 0:
            mae, mse = validate(model, val_loader, device)
            print(f"[{epoch:03d}] val MAE {mae:.1f} MSE {mse:.1f}", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "last.pth"))
            if mae < best_mae:
                best_mae = mae
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
