"""Self-supervised isotropic restoration of anisotropic FIB-SEM stacks.

High-resolution XY planes are degraded along one axis (blur + subsample by the z/xy
anisotropy factor) and a 2D residual network learns to undo it; at inference the network
is applied to XZ / YZ planes.  Runs on the GPU partition with one Slurm task per GPU:

    #SBATCH --partition=gpu --nodes=2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    export MASTER_PORT=29431
    srun python 19_slurm_fibsem_isotropic_sr.py --stack /lustre/fibsem/hela_8x8x32.zarr --factor 4 --out /lustre/fibsem/runs/iso_01
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from scipy.ndimage import gaussian_filter1d
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stack", required=True)
    p.add_argument("--key", default="raw/s0")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--crop", type=int, default=128)
    p.add_argument("--n-crops", type=int, default=64000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def setup():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size


class DegradedXYCrops(Dataset):
    def __init__(self, path, key, crop, n, factor, z_range):
        self.arr = zarr.open(path, mode="r")[key]
        self.crop, self.n, self.factor = crop, n, factor
        self.z_range = z_range
        sub = np.asarray(self.arr[::16, ::16, ::16], dtype=np.float32)
        self.mu, self.sd = float(sub.mean()), float(sub.std()) + 1e-6

    def __len__(self):
        return self.n

    def degrade(self, img):
        # FIB slice thickness acts like a box/gaussian PSF along the milling axis
        blurred = gaussian_filter1d(img, sigma=self.factor / 2.0, axis=0, mode="reflect")
        low = blurred[::self.factor]
        up = F.interpolate(torch.from_numpy(low)[None, None], size=img.shape, mode="bilinear",
                           align_corners=False)[0, 0]
        return up.numpy()

    def __getitem__(self, idx):
        rng = np.random.default_rng(idx)
        z = int(rng.integers(*self.z_range))
        _, Y, X = self.arr.shape
        c = self.crop
        y, x = int(rng.integers(0, Y - c + 1)), int(rng.integers(0, X - c + 1))
        hr = (np.asarray(self.arr[z, y:y + c, x:x + c], dtype=np.float32) - self.mu) / self.sd
        if rng.random() < 0.5:
            hr = hr.T.copy()  # degrade along y or x
        lr = self.degrade(hr).astype(np.float32)
        return torch.from_numpy(lr)[None], torch.from_numpy(hr)[None]


class RCAB(nn.Module):
    def __init__(self, c, r=16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(c, c, 3, padding=1))
        self.att = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // r, 1), nn.ReLU(inplace=True),
                                 nn.Conv2d(c // r, c, 1), nn.Sigmoid())

    def forward(self, x):
        y = self.body(x)
        return x + y * self.att(y)


class IsoNet2D(nn.Module):
    def __init__(self, c=64, n_blocks=12):
        super().__init__()
        self.head = nn.Conv2d(1, c, 3, padding=1)
        self.body = nn.Sequential(*[RCAB(c) for _ in range(n_blocks)], nn.Conv2d(c, c, 3, padding=1))
        self.tail = nn.Conv2d(c, 1, 3, padding=1)

    def forward(self, x):
        h = self.head(x)
        return x + self.tail(h + self.body(h))


def psnr(pred, target):
    mse = F.mse_loss(pred, target, reduction="none").mean((1, 2, 3))
    rng = (target.amax((1, 2, 3)) - target.amin((1, 2, 3))).clamp(min=1e-6)
    return 10 * torch.log10(rng ** 2 / mse.clamp(min=1e-10))


def main():
    args = get_args()
    rank, world = setup()
    device = torch.device("cuda", torch.cuda.current_device())

    nz = zarr.open(args.stack, mode="r")[args.key].shape[0]
    split = int(0.9 * nz)
    train_ds = DegradedXYCrops(args.stack, args.key, args.crop, args.n_crops, args.factor, (0, split))
    val_ds = DegradedXYCrops(args.stack, args.key, args.crop, 256 * world, args.factor, (split, nz))
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size,
                        sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False),
                        num_workers=2)

    model = DDP(IsoNet2D().to(device), device_ids=[device.index])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} tasks, {len(train_dl)} steps/epoch, z split {split}/{nz}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for lr_img, hr_img in train_dl:
            lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        acc = torch.zeros(3, device=device)  # psnr sum, baseline psnr sum, count
        with torch.no_grad():
            for lr_img, hr_img in val_dl:
                lr_img, hr_img = lr_img.to(device), hr_img.to(device)
                acc[0] += psnr(model.module(lr_img), hr_img).sum()
                acc[1] += psnr(lr_img, hr_img).sum()
                acc[2] += lr_img.shape[0]
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch:3d} val PSNR {(acc[0] / acc[2]).item():.2f} dB "
                  f"(bilinear {(acc[1] / acc[2]).item():.2f} dB) {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "factor": args.factor},
                       os.path.join(args.out, f"iso_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
