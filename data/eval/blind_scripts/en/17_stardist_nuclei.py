#!/usr/bin/env python
"""
StarDist-2D style nuclei model in PyTorch (object probability + 32 radial
distances), trained on the facility's pooled H2B / DAPI annotations.

Targets (prob + dist) are precomputed by ``prepare_stardist_targets.py`` and
stored per image as <name>_prob.tif (H, W) and <name>_dist.tif (32, H, W).

    torchrun --nproc_per_node=4 17_stardist_nuclei.py --data /data/nuclei/stardist_targets \
        --out runs/stardist_pt --epochs 400
"""
import argparse
import glob
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_RAYS = 32


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--patch", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--val-frac", type=float, default=0.15)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class StarDistPatches(Dataset):
    def __init__(self, names, patch, augment):
        self.names, self.patch, self.augment = names, patch, augment

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        n = self.names[i]
        img = tifffile.imread(n + "_img.tif").astype(np.float32)
        prob = tifffile.imread(n + "_prob.tif").astype(np.float32)
        dist_ = tifffile.imread(n + "_dist.tif").astype(np.float32)
        H, W = img.shape
        p = self.patch
        y = np.random.randint(0, H - p + 1) if self.augment else (H - p) // 2
        x = np.random.randint(0, W - p + 1) if self.augment else (W - p) // 2
        img, prob, dist_ = img[y:y + p, x:x + p], prob[y:y + p, x:x + p], dist_[:, y:y + p, x:x + p]
        lo, hi = np.percentile(img, (1, 99.8))
        img = (img - lo) / (hi - lo + 1e-6)
        if self.augment and np.random.rand() < 0.5:
            # horizontal flip mirrors the rays: ray k -> ray (N/2 - k) mod N
            img, prob, dist_ = img[:, ::-1], prob[:, ::-1], dist_[:, :, ::-1]
            dist_ = dist_[(N_RAYS // 2 - np.arange(N_RAYS)) % N_RAYS]
        if self.augment:
            img = img * np.random.uniform(0.7, 1.3) + np.random.normal(0, 0.03)
        return (torch.from_numpy(img.copy())[None], torch.from_numpy(prob.copy())[None],
                torch.from_numpy(dist_.copy()))


class StarDistUNet(nn.Module):
    def __init__(self, n_rays=N_RAYS, c=32, depth=3):
        super().__init__()
        chans = [c * 2 ** i for i in range(depth + 1)]
        conv = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU(True),  # noqa
                                          nn.Conv2d(o, o, 3, padding=1), nn.ReLU(True))
        self.down = nn.ModuleList([conv(1 if i == 0 else chans[i - 1], chans[i]) for i in range(depth + 1)])
        self.up = nn.ModuleList([conv(chans[i + 1] + chans[i], chans[i]) for i in reversed(range(depth))])
        self.feat = nn.Sequential(nn.Conv2d(chans[0], 128, 3, padding=1), nn.ReLU(True))
        self.prob = nn.Conv2d(128, 1, 1)
        self.dist = nn.Conv2d(128, n_rays, 1)

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.down):
            x = d(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for u in self.up:
            s = skips.pop()
            x = u(torch.cat([F.interpolate(x, size=s.shape[-2:], mode="nearest"), s], 1))
        f = self.feat(x)
        return self.prob(f), F.relu(self.dist(f))


def stardist_loss(prob_logit, dist_pred, prob_t, dist_t, lam=0.2):
    l_prob = F.binary_cross_entropy_with_logits(prob_logit, prob_t)
    # distance loss weighted by object probability (as in StarDist)
    w = prob_t
    l_dist = (w * (dist_pred - dist_t).abs()).sum() / w.sum().clamp(min=1.0) / N_RAYS
    return l_prob + lam * l_dist, l_prob.detach(), l_dist.detach()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    names = sorted(f[:-len("_img.tif")] for f in glob.glob(os.path.join(args.data, "*_img.tif")))
    rng = np.random.RandomState(42)
    idx = rng.permutation(len(names))
    n_val = max(1, int(args.val_frac * len(names)))
    val_names = [names[i] for i in idx[:n_val]]
    train_names = [names[i] for i in idx[n_val:]]

    train_ds = StarDistPatches(train_names, args.patch, augment=True)
    val_ds = StarDistPatches(val_names, args.patch, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=args.workers)

    model = DDP(StarDistUNet().to(device), device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=40)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for img, prob_t, dist_t in train_dl:
            img, prob_t, dist_t = img.to(device), prob_t.to(device), dist_t.to(device)
            prob_logit, dist_pred = model(img)
            loss, lp, ld = stardist_loss(prob_logit, dist_pred, prob_t, dist_t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([lp, ld, torch.ones((), device=device)])

        model.eval()
        vacc = torch.zeros(2, device=device)
        with torch.no_grad():
            for img, prob_t, dist_t in val_dl:
                img, prob_t, dist_t = img.to(device), prob_t.to(device), dist_t.to(device)
                pl, dp = model.module(img)
                vacc += torch.stack([stardist_loss(pl, dp, prob_t, dist_t)[0], torch.ones((), device=device)])
        dist.all_reduce(acc)
        dist.all_reduce(vacc)
        val_loss = (vacc[0] / vacc[1].clamp(min=1)).item()
        sched.step(val_loss)

        if rank == 0:
            print(f"ep {epoch:3d}  prob {acc[0] / acc[2]:.4f}  dist {acc[1] / acc[2]:.4f}  val {val_loss:.4f}"
                  f"  {time.time() - t0:.0f}s", flush=True)
            if val_loss < best:
                best = val_loss
                torch.save({"model": model.module.state_dict(), "n_rays": N_RAYS, "epoch": epoch},
                           os.path.join(args.out, "stardist_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
