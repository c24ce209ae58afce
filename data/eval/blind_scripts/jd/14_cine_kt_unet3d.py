"""
Dynamic cardiac cine reconstruction (OCMR, coil-combined) with a 2D+t residual U-Net
and k-t undersampling (a different random Cartesian line pattern in every frame).

Network input: zero-filled complex frames as 2 channels, (B, 2, T, H, W).
Loss: L1 on the complex image + data consistency at the end.

    torchrun --standalone --nproc_per_node=4 14_cine_kt_unet3d.py --data /data/ocmr_cine_npz --R 8
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def to_device(batch):
    return [t.to(DEVICE, non_blocking=True) for t in batch]


def kt_mask(T, ny, R, acs, rng):
    """Random Cartesian pattern per frame, same number of lines in each, fully sampled centre."""
    m = np.zeros((T, ny), np.float32)
    c = ny // 2
    n_lines = max(ny // R - acs, 0)
    outer = np.r_[0:c - acs // 2, c + acs // 2:ny]
    for t in range(T):
        m[t, rng.choice(outer, n_lines, replace=False)] = 1
    m[:, c - acs // 2:c + acs // 2] = 1
    return m


def fft_img(x):
    return torch.fft.fftshift(torch.fft.fft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def ifft_k(k):
    return torch.fft.fftshift(torch.fft.ifft2(torch.fft.ifftshift(k, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


class CineSet(Dataset):
    def __init__(self, files, R, acs, T=16, fixed=False):
        self.files, self.R, self.acs, self.T, self.fixed = files, R, acs, T, fixed

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = torch.from_numpy(np.load(self.files[i]))       # (T_full, H, W) complex64
        rng = np.random.default_rng(i) if self.fixed else np.random.default_rng()
        t0 = 0 if self.fixed else int(rng.integers(0, img.shape[0] - self.T + 1))
        img = img[t0:t0 + self.T]
        img = img / img.abs().max()
        m = torch.from_numpy(kt_mask(self.T, img.shape[-1], self.R, self.acs, rng))[:, None, :]  # (T,1,W)
        k = fft_img(img) * m
        zf = ifft_k(k)
        as2ch = lambda z: torch.stack([z.real, z.imag], 0)
        return as2ch(zf), as2ch(k), m[None].expand(2, -1, img.shape[1], -1).contiguous(), as2ch(img)


class Res3D(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.c1 = nn.Conv3d(i, o, 3, padding=1)
        self.c2 = nn.Conv3d(o, o, 3, padding=1)
        self.skip = nn.Conv3d(i, o, 1) if i != o else nn.Identity()

    def forward(self, x):
        return F.relu(self.skip(x) + self.c2(F.relu(self.c1(x))))


class UNet2dt(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.e1, self.e2, self.e3 = Res3D(2, c), Res3D(c, 2 * c), Res3D(2 * c, 4 * c)
        self.d2, self.d1 = Res3D(6 * c, 2 * c), Res3D(3 * c, c)
        self.out = nn.Conv3d(c, 2, 1)
        self.pool = nn.MaxPool3d((1, 2, 2))

    def forward(self, x, k0, m):
        a = self.e1(x)
        b = self.e2(self.pool(a))
        c = self.e3(self.pool(b))
        up = lambda t, r: F.interpolate(t, size=r.shape[2:], mode="trilinear", align_corners=False)
        y = self.d1(torch.cat([up(self.d2(torch.cat([up(c, b), b], 1)), a), a], 1))
        x = x + self.out(y)
        # hard data consistency on the sampled k-t locations
        z = torch.complex(x[:, 0], x[:, 1])
        k = fft_img(z)
        k = torch.where(m[:, 0] > 0, torch.complex(k0[:, 0], k0[:, 1]), k)
        z = ifft_k(k)
        return torch.stack([z.real, z.imag], 1)


def psnr_ssim_proxy(rec, gt):
    r, g = rec.norm(dim=1), gt.norm(dim=1)
    mse = ((r - g) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(g.flatten(1).amax(1) ** 2 / mse)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--R", type=int, default=8)
    ap.add_argument("--acs", type=int, default=8)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--out", default="out/cine_kt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    files = sorted(glob.glob(os.path.join(args.data, "*.npy")))
    n_val = len(files) // 8
    train_ds = CineSet(files[n_val:], args.R, args.acs, args.frames)
    val_ds = CineSet(files[:n_val], args.R, args.acs, args.frames, fixed=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 1, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), num_workers=2)

    model = UNet2dt().cuda(local_rank)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=local_rank)
        for zf, k0, m, gt in train_loader:
            zf, k0, m, gt = to_device((zf, k0, m, gt))
            rec = model(zf, k0, m)
            loss = F.l1_loss(rec, gt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=loss.device)])

        model.eval()
        acc = torch.zeros(2, device=local_rank)
        with torch.no_grad():
            for zf, k0, m, gt in val_loader:
                zf, k0, m, gt = to_device((zf, k0, m, gt))
                p = psnr_ssim_proxy(model.module(zf, k0, m), gt)
                acc += torch.stack([p.sum(), torch.tensor(float(p.numel()), device=p.device)])
        dist.all_reduce(acc)
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch:03d} | train L1 {(run[0] / run[1]).item():.5f} | val PSNR {(acc[0] / acc[1]).item():.2f} "
                  f"| {time.time() - tic:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
