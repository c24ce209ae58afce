# -*- coding: utf-8 -*-
"""
DC-CNN (deep cascade of CNNs with data consistency) on IXI T1, retrospectively undersampled.

k-space is simulated from the magnitude slices (FFT), undersampled with a 1D variable-density
Cartesian mask (acceleration R, fully sampled centre), and the network alternates CNN denoising
with hard data consistency.

Launch (one node, 4 GPUs):
    torchrun --nproc_per_node=4 09_dccnn_ixi_simulated.py --root /data/IXI-T1-slices --R 6
"""
import argparse
import glob
import logging
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser(description="DC-CNN on IXI")
    parser.add_argument("--root", type=str, required=True)
    parser.add_argument("--R", type=int, default=6, help="acceleration factor")
    parser.add_argument("--acs", type=int, default=16, help="number of central lines")
    parser.add_argument("--n-cascades", type=int, default=5)
    parser.add_argument("--n-convs", type=int, default=5)
    parser.add_argument("--nf", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--save_dir", type=str, default="./ckpt_dccnn")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def vd_mask(n, R, acs, rng):
    """1D variable-density mask, Gaussian pdf around the centre."""
    x = np.arange(n) - n // 2
    pdf = np.exp(-0.5 * (x / (n / 6.0)) ** 2)
    pdf[n // 2 - acs // 2: n // 2 + acs // 2] = 0
    pdf = pdf / pdf.sum()
    n_rand = max(n // R - acs, 0)
    idx = rng.choice(n, n_rand, replace=False, p=pdf)
    m = np.zeros(n, np.float32)
    m[idx] = 1
    m[n // 2 - acs // 2: n // 2 + acs // 2] = 1
    return m


class IXISlices(Dataset):
    def __init__(self, files, R, acs, fixed_masks=False):
        self.files = files
        self.R, self.acs = R, acs
        self.fixed_masks = fixed_masks

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = np.load(self.files[i]).astype(np.float32)  # 256x256, [0,1]
        rng = np.random.default_rng(i) if self.fixed_masks else np.random.default_rng()
        mask = np.tile(vd_mask(img.shape[1], self.R, self.acs, rng)[None, :], (img.shape[0], 1))
        k = np.fft.fftshift(np.fft.fft2(img, norm="ortho")) * mask
        zf = np.fft.ifft2(np.fft.ifftshift(k), norm="ortho")
        to_t = lambda a: torch.from_numpy(np.stack([a.real, a.imag]).astype(np.float32))
        return to_t(zf), to_t(k), torch.from_numpy(mask)[None], torch.from_numpy(img)[None]


class DataConsistency(nn.Module):
    def forward(self, x, k0, mask):
        xc = torch.complex(x[:, 0], x[:, 1])
        k = torch.fft.fftshift(torch.fft.fft2(xc, norm="ortho"), dim=(-2, -1))
        k0c = torch.complex(k0[:, 0], k0[:, 1])
        m = mask[:, 0]
        k = (1 - m) * k + m * k0c
        out = torch.fft.ifft2(torch.fft.ifftshift(k, dim=(-2, -1)), norm="ortho")
        return torch.stack([out.real, out.imag], 1)


class CascadeNet(nn.Module):
    def __init__(self, n_cascades, n_convs, nf):
        super().__init__()
        self.cnns = nn.ModuleList()
        for _ in range(n_cascades):
            layers = [nn.Conv2d(2, nf, 3, padding=1), nn.ReLU(True)]
            for _ in range(n_convs - 2):
                layers += [nn.Conv2d(nf, nf, 3, padding=1), nn.ReLU(True)]
            layers += [nn.Conv2d(nf, 2, 3, padding=1)]
            self.cnns.append(nn.Sequential(*layers))
        self.dc = DataConsistency()

    def forward(self, x, k0, mask):
        for cnn in self.cnns:
            x = x + cnn(x)
            x = self.dc(x, k0, mask)
        return x


def psnr(a, b):
    mse = F.mse_loss(a, b, reduction="none").flatten(1).mean(1)
    peak = b.flatten(1).amax(1)
    return 10 * torch.log10(peak ** 2 / mse)


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda")

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    logger = logging.getLogger()
    logger.info("world size %d, args %s", world_size, vars(args))

    subjects = sorted(glob.glob(os.path.join(args.root, "IXI*")))
    n_val = max(1, len(subjects) // 10)
    tr_files = [f for s in subjects[n_val:] for f in sorted(glob.glob(os.path.join(s, "*.npy")))]
    va_files = [f for s in subjects[:n_val] for f in sorted(glob.glob(os.path.join(s, "*.npy")))]

    train_set = IXISlices(tr_files, args.R, args.acs)
    val_set = IXISlices(va_files, args.R, args.acs, fixed_masks=True)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = CascadeNet(args.n_cascades, args.n_convs, args.nf).cuda()
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 45], gamma=0.5)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for i, (zf, k0, mask, gt) in enumerate(train_loader):
            zf, k0, mask, gt = zf.to(device), k0.to(device), mask.to(device), gt.to(device)
            rec = model(zf, k0, mask)
            mag = torch.sqrt(rec[:, 0:1] ** 2 + rec[:, 1:2] ** 2 + 1e-12)
            loss = F.mse_loss(mag, gt)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach() * zf.shape[0], torch.tensor(float(zf.shape[0]), device=device)])
            if i % 100 == 0:
                logger.info("epoch %d iter %d/%d loss %.6f", epoch, i, len(train_loader), loss.item())
        scheduler.step()
        dist.all_reduce(run)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for zf, k0, mask, gt in val_loader:
                zf, k0, mask, gt = zf.to(device), k0.to(device), mask.to(device), gt.to(device)
                rec = model.module(zf, k0, mask)
                mag = torch.sqrt(rec[:, 0:1] ** 2 + rec[:, 1:2] ** 2 + 1e-12)
                acc += torch.stack([psnr(mag, gt).sum(), torch.tensor(float(gt.shape[0]), device=device)])
        dist.all_reduce(acc)
        logger.info("epoch %d train mse %.6f | val PSNR %.2f dB", epoch,
                    (run[0] / run[1]).item(), (acc[0] / acc[1]).item())

        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.save_dir, "checkpoint.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
