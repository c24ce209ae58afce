"""Sub-pixel match refinement: given a coarse match (x0, x1), predict the offset of x1 inside a local window.

Training patches are cut on the fly around coarse matches exported for MegaDepth pairs (one h5 per
pair: image0/image1 grayscale, coarse matches, GT location of each x0 in image 1 from depth).

    torchrun --nproc_per_node=8 19_subpixel_refiner_patches.py --pairs_dir /data/md_coarse_matches --out runs/refiner
"""
import argparse
import glob
import os
import random

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs_dir", required=True)
    p.add_argument("--out", default="runs/refiner")
    p.add_argument("--val_fraction", type=float, default=0.05)
    p.add_argument("--window", type=int, default=8, help="search window radius (px)")
    p.add_argument("--matches_per_pair", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=8, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class CoarseMatchPatches(Dataset):
    def __init__(self, files, window, n_matches, train):
        self.files, self.r, self.n, self.train = files, window, n_matches, train
        self.p = 2 * window + 8  # context around the window

    def __len__(self):
        return len(self.files)

    def _crop(self, img, centers):
        pad = self.p
        img = np.pad(img, pad, mode="reflect")
        c = np.round(centers).astype(int) + pad
        half = self.p // 2
        return np.stack([img[y - half:y + half, x - half:x + half] for x, y in c])

    def __getitem__(self, i):
        with h5py.File(self.files[i], "r") as f:
            im0, im1 = f["image0"][()], f["image1"][()]
            m = f["coarse_matches"][()]  # (N, 4): x0 y0 x1 y1 (coarse, 8px grid)
            gt = f["gt_x1"][()]  # (N, 2): GT location of x0 in image 1, NaN if unknown
        ok = np.isfinite(gt).all(1) & (np.abs(gt - m[:, 2:]).max(1) < self.r)
        m, gt = m[ok], gt[ok]
        rng = np.random if self.train else np.random.RandomState(i)
        sel = rng.choice(len(m), self.n, replace=len(m) < self.n) if len(m) else np.zeros(0, int)
        m, gt = m[sel], gt[sel]
        if len(m) == 0:
            m, gt = np.zeros((self.n, 4)), np.zeros((self.n, 2))
            valid = np.zeros(self.n, bool)
        else:
            valid = np.ones(self.n, bool)
        p0 = self._crop(im0.astype(np.float32) / 255.0, m[:, :2])
        p1 = self._crop(im1.astype(np.float32) / 255.0, m[:, 2:])
        off = (gt - np.round(m[:, 2:])).astype(np.float32)  # target offset w.r.t. the patch centre
        return torch.from_numpy(p0)[:, None], torch.from_numpy(p1)[:, None], torch.from_numpy(off), \
            torch.from_numpy(valid)


class Refiner(nn.Module):
    def __init__(self, window, dim=64, temp=0.1):
        super().__init__()
        self.r, self.temp = window, temp
        self.enc = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(True),
            nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(True),
            nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(True),
            nn.Conv2d(64, dim, 3, padding=1))

    def forward(self, p0, p1):
        f0, f1 = self.enc(p0), self.enc(p1)
        s = f0.shape[-1]
        c = s // 2
        q = F.normalize(f0[:, :, c, c], dim=1)
        win = F.normalize(f1[:, :, c - self.r:c + self.r + 1, c - self.r:c + self.r + 1], dim=1)
        heat = torch.einsum("bc,bchw->bhw", q, win).flatten(1) / self.temp
        prob = heat.softmax(1)
        k = 2 * self.r + 1
        ys, xs = torch.meshgrid(torch.arange(k, device=p0.device), torch.arange(k, device=p0.device), indexing="ij")
        grid = torch.stack([xs, ys], -1).reshape(-1, 2).float() - self.r
        mean = prob @ grid
        var = (prob @ grid ** 2 - mean ** 2).sum(1).clamp(min=1e-6)
        return mean, var


def refine_loss(mean, var, target, valid):
    # heteroscedastic L2 (as in the LoFTR fine loss): confident predictions are weighted up
    w = (1.0 / var.sqrt()).detach()
    w = w / w[valid].mean().clamp(min=1e-6)
    err = ((mean - target) ** 2).sum(1)
    return (w * err)[valid].mean(), err[valid].sqrt()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    files = sorted(glob.glob(os.path.join(args.pairs_dir, "*.h5")))
    random.shuffle(files)
    n_val = int(len(files) * args.val_fraction)
    val_files, train_files = files[:n_val], files[n_val:]

    train_ds = CoarseMatchPatches(train_files, args.window, args.matches_per_pair, train=True)
    val_ds = CoarseMatchPatches(val_files, args.window, args.matches_per_pair, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        num_workers=2)

    model = DDP(Refiner(args.window).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_files)} train / {len(val_files)} val pairs")

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tr = torch.zeros(2, device=device)
        for p0, p1, off, valid in train_dl:
            p0, p1 = p0.to(device).flatten(0, 1), p1.to(device).flatten(0, 1)
            off, valid = off.to(device).flatten(0, 1), valid.to(device).flatten(0, 1)
            mean, var = model(p0, p1)
            loss, _ = refine_loss(mean, var, off, valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        ev = torch.zeros(4, device=device)  # sum err, <0.5px, <1px, count
        with torch.no_grad():
            for p0, p1, off, valid in val_dl:
                p0, p1 = p0.to(device).flatten(0, 1), p1.to(device).flatten(0, 1)
                off, valid = off.to(device).flatten(0, 1), valid.to(device).flatten(0, 1)
                mean, var = model.module(p0, p1)
                _, err = refine_loss(mean, var, off, valid)
                ev += torch.stack([err.sum(), (err < 0.5).sum(), (err < 1.0).sum(),
                                   torch.tensor(err.numel(), device=device)]).float()
        dist.all_reduce(tr)
        dist.all_reduce(ev)
        if rank == 0:
            n = ev[3].clamp(min=1)
            epe = (ev[0] / n).item()
            print(f"epoch {epoch}: train {tr[0] / tr[1]:.4f} | val EPE {epe:.3f}px "
                  f"<0.5px {(ev[1] / n).item():.3f} <1px {(ev[2] / n).item():.3f}", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "epe": epe}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if epe < best:
                best = epe
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
