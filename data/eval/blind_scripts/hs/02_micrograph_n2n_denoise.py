"""Noise2Noise denoiser for cryo-EM micrographs (even/odd frame sums).

Each movie was motion-corrected twice (even frames / odd frames) with MotionCor2
``-SplitSum 1``; the two half sums are independent noisy observations of the same
signal, so we train a 2D U-Net to predict one half from the other, symmetrically.

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc_per_node=8 02_micrograph_n2n_denoise.py \
        --even /scratch/proj/EMPIAR-10025/even --odd /scratch/proj/EMPIAR-10025/odd \
        --out /scratch/proj/denoise/n2n_10025
"""
import argparse
import glob
import math
import os
import random

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--even", required=True)
    ap.add_argument("--odd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bin", type=int, default=2)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--crops-per-mic", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--num-workers", type=int, default=8)
    return ap.parse_args()


def load_mic(path, binning):
    with mrcfile.open(path, permissive=True) as m:
        x = m.data.astype(np.float32)
    if binning > 1:
        h, w = (x.shape[0] // binning) * binning, (x.shape[1] // binning) * binning
        x = x[:h, :w].reshape(h // binning, binning, w // binning, binning).mean((1, 3))
    mu, sd = x.mean(), x.std() + 1e-6
    return (x - mu) / sd


class HalfSumCrops(Dataset):
    def __init__(self, pairs, binning, crop, crops_per_mic, train=True):
        self.pairs = pairs
        self.binning = binning
        self.crop = crop
        self.cpm = crops_per_mic
        self.train = train
        self._cache = {}

    def __len__(self):
        return len(self.pairs) * self.cpm

    def _get(self, i):
        if i not in self._cache:
            if len(self._cache) > 16:
                self._cache.pop(next(iter(self._cache)))
            e, o = self.pairs[i]
            self._cache[i] = (load_mic(e, self.binning), load_mic(o, self.binning))
        return self._cache[i]

    def __getitem__(self, idx):
        mic_idx = idx // self.cpm
        even, odd = self._get(mic_idx)
        h, w = even.shape
        c = self.crop
        if self.train:
            y, x = random.randint(0, h - c), random.randint(0, w - c)
        else:
            k = idx % self.cpm
            g = int(math.sqrt(self.cpm))
            y = (k // g) * (h - c) // max(g - 1, 1)
            x = (k % g) * (w - c) // max(g - 1, 1)
        a, b = even[y:y + c, x:x + c], odd[y:y + c, x:x + c]
        if self.train:
            k = random.randint(0, 3)
            a, b = np.rot90(a, k), np.rot90(b, k)
            if random.random() < 0.5:
                a, b = a[:, ::-1], b[:, ::-1]
        return torch.from_numpy(a.copy())[None], torch.from_numpy(b.copy())[None]


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
            nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))

    def forward(self, x):
        return self.body(x)


class DenoiseUNet(nn.Module):
    def __init__(self, nf=48):
        super().__init__()
        self.e1, self.e2, self.e3, self.e4 = Down(1, nf), Down(nf, nf), Down(nf, nf), Down(nf, nf)
        self.d3, self.d2, self.d1 = Down(2 * nf, 2 * nf), Down(3 * nf, 2 * nf), Down(3 * nf, 2 * nf)
        self.out = nn.Sequential(nn.Conv2d(2 * nf + 1, 64, 3, padding=1), nn.LeakyReLU(0.1),
                                 nn.Conv2d(64, 1, 1))

    def forward(self, x):
        s1 = self.e1(x)
        s2 = self.e2(F.max_pool2d(s1, 2))
        s3 = self.e3(F.max_pool2d(s2, 2))
        b = self.e4(F.max_pool2d(s3, 2))
        y = self.d3(torch.cat([F.interpolate(b, scale_factor=2.0), s3], 1))
        y = self.d2(torch.cat([F.interpolate(y, scale_factor=2.0), s2], 1))
        y = self.d1(torch.cat([F.interpolate(y, scale_factor=2.0), s1], 1))
        return self.out(torch.cat([y, x], 1))


def pair_files(even_dir, odd_dir):
    evens = sorted(glob.glob(os.path.join(even_dir, "*.mrc")))
    pairs = []
    for e in evens:
        o = os.path.join(odd_dir, os.path.basename(e))
        if os.path.exists(o):
            pairs.append((e, o))
    return pairs


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")

    pairs = pair_files(args.even, args.odd)
    n_val = max(1, int(len(pairs) * args.val_frac))
    # deterministic split: last micrographs in sorted order are held out
    train_pairs, val_pairs = pairs[:-n_val], pairs[-n_val:]
    train_ds = HalfSumCrops(train_pairs, args.bin, args.crop, args.crops_per_mic)
    val_ds = HalfSumCrops(val_pairs, args.bin, args.crop, 16, train=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=4)

    net = DenoiseUNet().to(dev)
    net = DistributedDataParallel(net, device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_pairs)} train / {len(val_pairs)} val micrographs, "
              f"{world_size} GPUs x {args.batch_size}", flush=True)

    for epoch in range(args.epochs):
        net.train()
        train_sampler.set_epoch(epoch)
        tot, n = torch.zeros((), device=dev), 0
        for even, odd in train_dl:
            even = even.to(dev, non_blocking=True)
            odd = odd.to(dev, non_blocking=True)
            pred_odd = net(even)
            pred_even = net(odd)
            loss = 0.5 * (F.mse_loss(pred_odd, odd) + F.mse_loss(pred_even, even))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.detach()
            n += 1
        dist.all_reduce(tot)
        train_loss = tot.item() / (n * world_size)

        net.eval()
        vsum = torch.zeros(2, device=dev)
        with torch.no_grad():
            for even, odd in val_dl:
                even, odd = even.to(dev), odd.to(dev)
                vsum[0] += F.mse_loss(net.module(even), odd, reduction="sum")
                vsum[1] += odd.numel()
        dist.all_reduce(vsum)
        val_loss = (vsum[0] / vsum[1]).item()

        if rank == 0:
            print(f"epoch {epoch:3d}  train {train_loss:.5f}  val {val_loss:.5f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
            torch.save({"epoch": epoch, "state_dict": net.module.state_dict(),
                        "optimizer": opt.state_dict(), "args": vars(args)},
                       os.path.join(args.out, f"n2n_epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
