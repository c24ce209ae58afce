"""Ribosome / FAS segmentation in cellular tomograms (DeePiCt-style 3D U-Net).

Raw tomograms are large float32 MRCs on the group share; on first use each one is
binned, normalised and stored as float16 .npy next to its label map in --cache so
that DataLoader workers can memory-map it.

    torchrun --nnodes=1 --nproc_per_node=4 05_tomo_ribosome_seg_cached.py \
        --tomo-list splits/train.txt --val-list splits/val.txt \
        --cache /g/scb/cache/ribo_bin2 --out /g/scb/runs/ribo_seg_07
"""
import argparse
import logging
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy import ndimage
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tomo-list", required=True)
    p.add_argument("--val-list", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--binning", type=int, default=2)
    p.add_argument("--patch", type=int, default=64)
    p.add_argument("--n-classes", type=int, default=3)
    p.add_argument("--patches-per-tomo", type=int, default=400)
    p.add_argument("--fg-ratio", type=float, default=0.6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def read_list(path):
    with open(path) as f:
        return [l.split() for l in f if l.strip() and not l.startswith("#")]


def cache_tomogram(tomo_path, label_path, cache_dir, binning):
    """Bin + normalise a tomogram and its labels, store as .npy; return the cache paths."""
    name = os.path.splitext(os.path.basename(tomo_path))[0]
    raw_npy = os.path.join(cache_dir, f"{name}_bin{binning}.npy")
    lab_npy = os.path.join(cache_dir, f"{name}_bin{binning}_labels.npy")
    if os.path.exists(raw_npy) and os.path.exists(lab_npy):
        return raw_npy, lab_npy
    with mrcfile.open(tomo_path, permissive=True) as m:
        vol = m.data.astype(np.float32)
    with mrcfile.open(label_path, permissive=True) as m:
        lab = m.data.astype(np.uint8)
    if binning > 1:
        vol = ndimage.zoom(vol, 1.0 / binning, order=1)
        lab = lab[::binning, ::binning, ::binning]
    lo, hi = np.percentile(vol, [0.5, 99.5])
    vol = np.clip((vol - lo) / (hi - lo), 0, 1) * 2 - 1
    np.save(raw_npy, vol.astype(np.float16))
    np.save(lab_npy, lab)
    return raw_npy, lab_npy


class PatchDataset(Dataset):
    def __init__(self, entries, patch, per_tomo, fg_ratio, seed, train=True):
        self.raw = [np.load(r, mmap_mode="r") for r, _ in entries]
        self.lab = [np.load(l, mmap_mode="r") for _, l in entries]
        self.patch, self.train = patch, train
        rng = np.random.default_rng(seed)
        self.centers = []
        h = patch // 2
        for t, lab in enumerate(self.lab):
            shape = np.array(lab.shape)
            fg = np.argwhere(lab[h:-h, h:-h, h:-h] > 0) + h
            n_fg = int(per_tomo * fg_ratio) if len(fg) else 0
            if n_fg:
                for c in fg[rng.choice(len(fg), n_fg)]:
                    self.centers.append((t, *c))
            for _ in range(per_tomo - n_fg):
                self.centers.append((t, *[rng.integers(h, s - h) for s in shape]))

    def __len__(self):
        return len(self.centers)

    def __getitem__(self, i):
        t, z, y, x = self.centers[i]
        h = self.patch // 2
        raw = np.asarray(self.raw[t][z - h:z + h, y - h:y + h, x - h:x + h], dtype=np.float32)
        lab = np.asarray(self.lab[t][z - h:z + h, y - h:y + h, x - h:x + h], dtype=np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                raw, lab = raw[:, :, ::-1], lab[:, :, ::-1]
            k = np.random.randint(4)
            raw, lab = np.rot90(raw, k, (1, 2)), np.rot90(lab, k, (1, 2))
        return torch.from_numpy(raw.copy())[None], torch.from_numpy(lab.copy())


def block(i, o):
    return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(inplace=True),
                         nn.Conv3d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, n_classes, f=(32, 64, 128)):
        super().__init__()
        self.e0, self.e1, self.e2 = block(1, f[0]), block(f[0], f[1]), block(f[1], f[2])
        self.u1 = nn.ConvTranspose3d(f[2], f[1], 2, 2)
        self.d1 = block(2 * f[1], f[1])
        self.u0 = nn.ConvTranspose3d(f[1], f[0], 2, 2)
        self.d0 = block(2 * f[0], f[0])
        self.out = nn.Conv3d(f[0], n_classes, 1)

    def forward(self, x):
        x0 = self.e0(x)
        x1 = self.e1(F.max_pool3d(x0, 2))
        x2 = self.e2(F.max_pool3d(x1, 2))
        y = self.d1(torch.cat([self.u1(x2), x1], 1))
        y = self.d0(torch.cat([self.u0(y), x0], 1))
        return self.out(y)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    os.makedirs(args.cache, exist_ok=True)
    train_entries = [cache_tomogram(t, l, args.cache, args.binning) for t, l in read_list(args.tomo_list)]
    val_entries = [cache_tomogram(t, l, args.cache, args.binning) for t, l in read_list(args.val_list)]

    train_ds = PatchDataset(train_entries, args.patch, args.patches_per_tomo, args.fg_ratio, seed=1)
    val_ds = PatchDataset(val_entries, args.patch, 100, args.fg_ratio, seed=2, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=4)

    model = DDP(UNet(args.n_classes).to(device), device_ids=[local_rank])
    # background is ~95% of voxels
    class_w = torch.tensor([0.1] + [1.0] * (args.n_classes - 1), device=device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.3)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("%d train / %d val patches on %d GPUs", len(train_ds), len(val_ds), world)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for raw, lab in train_dl:
            raw, lab = raw.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            loss = F.cross_entropy(model(raw), lab, weight=class_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach() * raw.size(0), torch.tensor(raw.size(0), device=device, dtype=torch.float)])
        sched.step()

        model.eval()
        inter = torch.zeros(args.n_classes, device=device)
        union = torch.zeros(args.n_classes, device=device)
        with torch.no_grad():
            for raw, lab in val_dl:
                pred = model.module(raw.to(device)).argmax(1)
                lab = lab.to(device)
                for c in range(1, args.n_classes):
                    inter[c] += ((pred == c) & (lab == c)).sum()
                    union[c] += ((pred == c) | (lab == c)).sum()
        for t in (tl, inter, union):
            dist.all_reduce(t)
        iou = (inter[1:] / union[1:].clamp(min=1)).cpu().numpy()
        miou = float(iou.mean())
        logger.info("epoch %d loss %.4f IoU %s mIoU %.4f (%.0fs)", epoch, (tl[0] / tl[1]).item(),
                    np.round(iou, 3).tolist(), miou, time.time() - t0)
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "epoch": epoch, "miou": miou, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if miou > best:
                best = miou
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
