"""EDSR-baseline x4 on DIV2K, multi-GPU (DDP), auto-resume from the latest checkpoint.

Usage:
    torchrun --standalone --nproc_per_node=4 04_edsr_x4_baseline.py --config configs/edsr_baseline_x4.json
"""
import argparse
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import List

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    train_hr: str = "/datasets/DIV2K/DIV2K_train_HR"
    train_lr: str = "/datasets/DIV2K/DIV2K_train_LR_bicubic/X4"
    val_hr: str = "/datasets/benchmark/Set14/HR"
    val_lr: str = "/datasets/benchmark/Set14/LR_bicubic/X4"
    scale: int = 4
    n_resblocks: int = 16
    n_feats: int = 64
    res_scale: float = 1.0
    patch_size: int = 192  # HR patch
    batch_size: int = 16   # total, split over GPUs
    lr: float = 1e-4
    epochs: int = 300
    decay: List[int] = field(default_factory=lambda: [200])
    ckpt_dir: str = "checkpoints/edsr_baseline_x4"
    workers: int = 8
    repeat: int = 20  # DIV2K has 800 images, iterate over it several times per "epoch"


class MeanShift(nn.Conv2d):
    def __init__(self, rgb_range=255, sign=-1, mean=(0.4488, 0.4371, 0.4040)):
        super().__init__(3, 3, kernel_size=1)
        self.weight.data = torch.eye(3).view(3, 3, 1, 1)
        self.bias.data = sign * rgb_range * torch.tensor(mean)
        for p in self.parameters():
            p.requires_grad = False


class ResBlock(nn.Module):
    def __init__(self, n_feats, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(n_feats, n_feats, 3, padding=1), nn.ReLU(True),
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        nf = cfg.n_feats
        self.sub_mean = MeanShift(sign=-1)
        self.add_mean = MeanShift(sign=1)
        self.head = nn.Conv2d(3, nf, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(nf, cfg.res_scale) for _ in range(cfg.n_resblocks)],
                                  nn.Conv2d(nf, nf, 3, padding=1))
        up = []
        for _ in range(int(np.log2(cfg.scale))):
            up += [nn.Conv2d(nf, 4 * nf, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(nf, 3, 3, padding=1))

    def forward(self, x):
        x = self.head(self.sub_mean(x))
        x = x + self.body(x)
        return self.add_mean(self.tail(x))


class SRData(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, patch_size=None, repeat=1):
        names = sorted(f for f in os.listdir(hr_dir) if f.endswith(".png"))
        self.hr = [os.path.join(hr_dir, n) for n in names]
        self.lr = [os.path.join(lr_dir, n.replace(".png", f"x{scale}.png")) for n in names]
        self.scale, self.patch_size, self.repeat = scale, patch_size, repeat

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, idx):
        idx = idx % len(self.hr)
        hr, lr = imageio.imread(self.hr[idx]), imageio.imread(self.lr[idx])
        if self.patch_size:
            lp = self.patch_size // self.scale
            ih, iw = lr.shape[:2]
            iy, ix = random.randrange(0, ih - lp + 1), random.randrange(0, iw - lp + 1)
            ty, tx = iy * self.scale, ix * self.scale
            lr = lr[iy:iy + lp, ix:ix + lp]
            hr = hr[ty:ty + self.patch_size, tx:tx + self.patch_size]
            hflip, vflip, rot90 = random.random() < 0.5, random.random() < 0.5, random.random() < 0.5
            def aug(img):
                if hflip:
                    img = img[:, ::-1]
                if vflip:
                    img = img[::-1]
                if rot90:
                    img = img.transpose(1, 0, 2)
                return img
            lr, hr = aug(lr), aug(hr)
        lr = torch.from_numpy(np.ascontiguousarray(lr.transpose(2, 0, 1))).float()
        hr = torch.from_numpy(np.ascontiguousarray(hr.transpose(2, 0, 1))).float()
        return lr, hr, os.path.basename(self.hr[idx])


def calc_psnr(sr, hr, scale, rgb_range=255):
    diff = (sr - hr) / rgb_range
    gray_coeffs = torch.tensor([65.738, 129.057, 25.064], device=sr.device).view(1, 3, 1, 1) / 256
    diff = diff.mul(gray_coeffs).sum(dim=1)
    valid = diff[..., scale:-scale, scale:-scale]
    return -10 * torch.log10(valid.pow(2).mean()).item()


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="")
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_set = SRData(cfg.train_hr, cfg.train_lr, cfg.scale, cfg.patch_size, cfg.repeat)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=cfg.batch_size // world_size, sampler=sampler,
                        num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_set = SRData(cfg.val_hr, cfg.val_lr, cfg.scale)

    model = EDSR(cfg).to(device)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                 betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg.decay, gamma=0.5)

    start_epoch, best = 0, 0.0
    latest = os.path.join(cfg.ckpt_dir, "latest.pt")
    if os.path.isfile(latest):
        ckpt = torch.load(latest)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_psnr"]
        if rank == 0:
            print(f"resumed from {latest} (epoch {ckpt['epoch']})")

    ddp_model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(cfg.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0, running = time.time(), 0.0
        for i, (lr, hr, _) in enumerate(loader):
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            sr = ddp_model(lr)
            loss = F.l1_loss(sr, hr)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
            if rank == 0 and (i + 1) % 100 == 0:
                print(f"epoch {epoch} [{(i + 1) * cfg.batch_size}/{len(train_set)}] "
                      f"L1 {running / 100:.4f} {time.time() - t0:.1f}s", flush=True)
                running, t0 = 0.0, time.time()
        scheduler.step()

        if rank == 0:
            model.eval()
            psnrs = []
            with torch.no_grad():
                for j in range(len(val_set)):
                    lr, hr, name = val_set[j]
                    sr = model(lr.unsqueeze(0).to(device)).clamp(0, 255).round()
                    psnrs.append(calc_psnr(sr, hr.unsqueeze(0).to(device), cfg.scale))
            psnr = float(np.mean(psnrs))
            print(f"epoch {epoch}: Set14 PSNR {psnr:.3f} dB (best {max(best, psnr):.3f})", flush=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_psnr": max(best, psnr)}
            torch.save(state, latest + ".tmp")
            os.replace(latest + ".tmp", latest)
            if psnr > best:
                best = psnr
                torch.save(model.state_dict(), os.path.join(cfg.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
