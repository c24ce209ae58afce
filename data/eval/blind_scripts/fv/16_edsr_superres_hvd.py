"""EDSR x4 super-resolution on DIV2K patches.

Moved from Horovod (hvd.DistributedOptimizer, hvd.broadcast_parameters) to
torch DDP under torchrun. Checkpoints in `--ckpt-dir` are also consumed by
the separate inference/export script (tools/sr_infer.py).
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hr-dir", default="/data/DIV2K/DIV2K_train_HR")
    p.add_argument("--lr-dir", default="/data/DIV2K/DIV2K_train_LR_bicubic/X4")
    p.add_argument("--val-hr-dir", default="/data/DIV2K/DIV2K_valid_HR")
    p.add_argument("--val-lr-dir", default="/data/DIV2K/DIV2K_valid_LR_bicubic/X4")
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--patch", type=int, default=48, help="LR patch size")
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--repeat", type=int, default=20, help="patches per image per epoch")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--n-resblocks", type=int, default=32)
    p.add_argument("--n-feats", type=int, default=256)
    p.add_argument("--ckpt-dir", default="ckpt/edsr_x4")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class PairedPatches(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, patch, repeat, train=True):
        self.hr = sorted(glob.glob(os.path.join(hr_dir, "*.png")))
        self.lr = [os.path.join(lr_dir, os.path.basename(p).replace(".png", f"x{scale}.png")) for p in self.hr]
        self.scale, self.patch, self.repeat, self.train = scale, patch, repeat, train

    def __len__(self):
        return len(self.hr) * (self.repeat if self.train else 1)

    def __getitem__(self, i):
        i = i % len(self.hr)
        hr = np.asarray(Image.open(self.hr[i]).convert("RGB"))
        lr = np.asarray(Image.open(self.lr[i]).convert("RGB"))
        if self.train:
            ps, s = self.patch, self.scale
            y, x = random.randrange(lr.shape[0] - ps + 1), random.randrange(lr.shape[1] - ps + 1)
            lr = lr[y:y + ps, x:x + ps]
            hr = hr[y * s:(y + ps) * s, x * s:(x + ps) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr[::-1], hr[::-1]
            if random.random() < 0.5:
                lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1).float()
        return to_t(lr), to_t(hr)


class ResBlock(nn.Module):
    def __init__(self, n, res_scale=0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(n, n, 3, padding=1), nn.ReLU(True), nn.Conv2d(n, n, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, n_resblocks, n_feats, scale, rgb_mean=(114.4, 111.5, 103.0)):
        super().__init__()
        self.register_buffer("mean", torch.tensor(rgb_mean).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_resblocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(n_feats, 3, 3, padding=1))

    def forward(self, x):
        x = self.head(x - self.mean)
        x = x + self.body(x)
        return self.tail(x) + self.mean


def psnr(sr, hr, scale):
    sr = sr.clamp(0, 255).round()
    diff = (sr - hr)[..., scale:-scale, scale:-scale] / 255.0
    gray = diff.mul(torch.tensor([65.738, 129.057, 25.064], device=diff.device).view(1, 3, 1, 1) / 256).sum(1)
    return -10 * torch.log10(gray.pow(2).mean())


@torch.no_grad()
def validate(model, loader, scale, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for lr_img, hr_img in loader:
        sr = model(lr_img.to(device))
        acc += torch.stack([psnr(sr, hr_img.to(device), scale), torch.ones((), device=device)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    train_set = PairedPatches(args.hr_dir, args.lr_dir, args.scale, args.patch, args.repeat, train=True)
    val_set = PairedPatches(args.val_hr_dir, args.val_lr_dir, args.scale, args.patch, 1, train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    model = EDSR(args.n_resblocks, args.n_feats, args.scale).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=200, gamma=0.5)

    start_epoch, best_psnr = 0, 0.0
    latest = os.path.join(args.ckpt_dir, "latest.pt")
    if args.resume and os.path.exists(latest):
        ckpt = torch.load(latest, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_psnr = ckpt["epoch"] + 1, ckpt["best_psnr"]

    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0, running = time.time(), torch.zeros((), device=device)
        for lr_img, hr_img in train_loader:
            lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.detach()
        scheduler.step()
        dist.all_reduce(running)
        train_l1 = running.item() / (size * len(train_loader))

        val_psnr = validate(model, val_loader, args.scale, device)
        if rank == 0:
            print(f"epoch {epoch} l1 {train_l1:.3f} val PSNR {val_psnr:.3f} dB ({time.time() - t0:.0f}s)")
            os.makedirs(args.ckpt_dir, exist_ok=True)
            best_psnr = max(best_psnr, val_psnr)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_psnr": best_psnr},
                       latest)
            if val_psnr >= best_psnr:
                torch.save(model.state_dict(), os.path.join(args.ckpt_dir, "edsr_x4_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
