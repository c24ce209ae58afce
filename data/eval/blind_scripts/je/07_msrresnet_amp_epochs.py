"""MSRResNet (SRResNet without BN) x4, Charbonnier loss, mixed precision, epoch-based schedule.

    torchrun --standalone --nproc_per_node=4 07_msrresnet_amp_epochs.py --cfg configs/msrresnet_x4.json
"""
import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DEFAULTS = {
    "train_hr": "/data/DF2K/HR_sub",
    "train_lr": "/data/DF2K/LR_bicubic_X4_sub",
    "val_hr": "/data/benchmark/Set5/HR",
    "val_lr": "/data/benchmark/Set5/LR_bicubic/X4",
    "scale": 4,
    "gt_size": 128,
    "batch_size": 16,
    "epochs": 60,
    "lr": 2e-4,
    "min_lr": 1e-7,
    "num_block": 16,
    "workers": 6,
    "grad_clip": 0.5,
    "out_dir": "experiments/msrresnet_x4",
}


def setup_logger(rank, out_dir):
    log = logging.getLogger("msrresnet")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s [%(levelname)s] %(message)s")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(fmt)
    log.addHandler(h)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(out_dir, "train.log"))
        fh.setFormatter(fmt)
        log.addHandler(fh)
    return log


class ResidualBlockNoBN(nn.Module):
    def __init__(self, nf=64):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf, nf, 3, 1, 1)
        for m in (self.conv1, self.conv2):
            nn.init.kaiming_normal_(m.weight, a=0, mode="fan_in")
            m.weight.data *= 0.1
            nn.init.zeros_(m.bias)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x), inplace=True))


class MSRResNet(nn.Module):
    def __init__(self, nf=64, num_block=16, upscale=4):
        super().__init__()
        self.upscale = upscale
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[ResidualBlockNoBN(nf) for _ in range(num_block)])
        self.upconv1 = nn.Conv2d(nf, nf * 4, 3, 1, 1)
        self.upconv2 = nn.Conv2d(nf, nf * 4, 3, 1, 1)
        self.pixel_shuffle = nn.PixelShuffle(2)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.1, inplace=True)

    def forward(self, x):
        feat = self.lrelu(self.conv_first(x))
        out = self.body(feat)
        out = self.lrelu(self.pixel_shuffle(self.upconv1(out)))
        out = self.lrelu(self.pixel_shuffle(self.upconv2(out)))
        out = self.conv_last(self.lrelu(self.conv_hr(out)))
        base = F.interpolate(x, scale_factor=self.upscale, mode="bilinear", align_corners=False)
        return out + base


def charbonnier(pred, target, eps=1e-12):
    return torch.sqrt((pred - target) ** 2 + eps).mean()


class PairedFolder(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, gt_size=None):
        self.hr = sorted(Path(hr_dir).glob("*.png"))
        self.lr = sorted(Path(lr_dir).glob("*.png"))
        assert [p.stem for p in self.hr] == [p.stem.replace(f"x{scale}", "") for p in self.lr]
        self.scale, self.gt_size = scale, gt_size

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = np.asarray(Image.open(self.hr[i]).convert("RGB"), np.float32) / 255.0
        lr = np.asarray(Image.open(self.lr[i]).convert("RGB"), np.float32) / 255.0
        s = self.scale
        if self.gt_size:
            lp = self.gt_size // s
            y, x = random.randint(0, lr.shape[0] - lp), random.randint(0, lr.shape[1] - lp)
            lr, hr = lr[y:y + lp, x:x + lp], hr[y * s:(y + lp) * s, x * s:(x + lp) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr[::-1], hr[::-1]
            if random.random() < 0.5:
                lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        else:
            hr = hr[:lr.shape[0] * s, :lr.shape[1] * s]
        return (torch.from_numpy(np.ascontiguousarray(lr.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(hr.transpose(2, 0, 1))))


def psnr_y(sr, hr, border):
    w = sr.new_tensor([65.481, 128.553, 24.966]).view(1, 3, 1, 1)
    y1 = (((sr.clamp(0, 1) * 255).round() / 255) * w).sum(1)[..., border:-border, border:-border]
    y2 = (hr * w).sum(1)[..., border:-border, border:-border]
    return 10 * torch.log10(255.0 ** 2 / ((y1 - y2) ** 2).mean())


@torch.no_grad()
def validate(net, val_set, device, scale):
    net.eval()
    vals = []
    for lr, hr in val_set:
        sr = net(lr.unsqueeze(0).to(device))
        vals.append(psnr_y(sr.float(), hr.unsqueeze(0).to(device), scale).item())
    net.train()
    return float(np.mean(vals))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    ap.add_argument("--resume", default="")
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    dist.barrier()
    log = setup_logger(rank, cfg["out_dir"])

    torch.manual_seed(0)
    net = MSRResNet(num_block=cfg["num_block"], upscale=cfg["scale"]).to(device)
    model = DDP(net, device_ids=[local_rank])

    train_set = PairedFolder(cfg["train_hr"], cfg["train_lr"], cfg["scale"], cfg["gt_size"])
    val_set = PairedFolder(cfg["val_hr"], cfg["val_lr"], cfg["scale"])
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"] // world, sampler=sampler,
                        num_workers=cfg["workers"], pin_memory=True, drop_last=True)

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.99))
    total_steps = cfg["epochs"] * len(loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps, eta_min=cfg["min_lr"])
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best = 0, 0.0
    if cli.resume:
        ckpt = torch.load(cli.resume, map_location=device)
        net.load_state_dict(ckpt["net"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", 0.0)
        log.info("resumed from %s (epoch %d)", cli.resume, ckpt["epoch"])

    log.info("%d training pairs, %d steps/epoch, %d GPUs", len(train_set), len(loader), world)
    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for lr, hr in loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                sr = model(lr)
            loss = charbonnier(sr.float(), hr)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        mean_loss = loss_sum.item() / (len(loader) * world)

        if rank == 0:
            psnr = validate(net, val_set, device, cfg["scale"])
            log.info("epoch %d  loss %.5f  Set5 PSNR-Y %.3f  lr %.2e  %.0fs", epoch, mean_loss, psnr,
                     scheduler.get_last_lr()[0], time.time() - t0)
            state = {"net": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best": max(best, psnr)}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
            if psnr > best:
                best = psnr
                torch.save(net.state_dict(), os.path.join(cfg["out_dir"], "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
