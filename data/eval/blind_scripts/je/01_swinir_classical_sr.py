#!/usr/bin/env python
"""SwinIR-style classical image super-resolution (bicubic x2/x3/x4) on DF2K patches.

    torchrun --nproc_per_node=8 01_swinir_classical_sr.py --data_root /data/DF2K --scale 4
"""
import argparse
import glob
import logging
import math
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("swinir")


# --------------------------------------------------------------------------- model
def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows, ws, h, w):
    b = int(windows.shape[0] / (h * w / ws / ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, -1)


def shift_attn_mask(h, w, ws, shift, device):
    img_mask = torch.zeros((1, h, w, 1), device=device)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img_mask[:, hs, wsl, :] = cnt
            cnt += 1
    mw = window_partition(img_mask, ws).view(-1, ws * ws)
    mask = mw.unsqueeze(1) - mw.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


class WindowAttention(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.rel_bias = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("rel_index", rel[..., 0] * (2 * ws - 1) + rel[..., 1], persistent=False)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.rel_bias, std=0.02)

    def forward(self, x, mask=None):
        bn, n, c = x.shape
        qkv = self.qkv(x).reshape(bn, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.rel_bias[self.rel_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(bn // nw, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(bn, n, c))


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, ws, shift, mlp_ratio=2.0):
        super().__init__()
        self.ws, self.shift = ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, hw):
        h, w = hw
        b, _, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, h, w, c)
        mask = None
        if self.shift > 0:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
            mask = shift_attn_mask(h, w, self.ws, self.shift, x.device)
        win = window_partition(x, self.ws).view(-1, self.ws * self.ws, c)
        win = self.attn(win, mask).view(-1, self.ws, self.ws, c)
        x = window_reverse(win, self.ws, h, w)
        if self.shift > 0:
            x = torch.roll(x, (self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.reshape(b, h * w, c)
        return x + self.mlp(self.norm2(x))


class RSTB(nn.Module):
    def __init__(self, dim, depth, heads, ws):
        super().__init__()
        self.blocks = nn.ModuleList(
            [SwinBlock(dim, heads, ws, 0 if i % 2 == 0 else ws // 2) for i in range(depth)])
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            t = blk(t, (h, w))
        return self.conv(t.transpose(1, 2).reshape(b, c, h, w)) + x


class SwinIR(nn.Module):
    def __init__(self, upscale=4, embed_dim=180, depths=(6, 6, 6, 6, 6, 6), heads=(6, 6, 6, 6, 6, 6),
                 window_size=8, img_range=1.0):
        super().__init__()
        self.upscale = upscale
        self.window_size = window_size
        self.img_range = img_range
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, embed_dim, 3, 1, 1)
        self.layers = nn.ModuleList([RSTB(embed_dim, d, h, window_size) for d, h in zip(depths, heads)])
        self.norm = nn.LayerNorm(embed_dim)
        self.conv_after_body = nn.Conv2d(embed_dim, embed_dim, 3, 1, 1)
        self.conv_before_upsample = nn.Sequential(nn.Conv2d(embed_dim, 64, 3, 1, 1), nn.LeakyReLU(inplace=True))
        up = []
        if upscale & (upscale - 1) == 0:
            for _ in range(int(math.log2(upscale))):
                up += [nn.Conv2d(64, 4 * 64, 3, 1, 1), nn.PixelShuffle(2)]
        else:
            up += [nn.Conv2d(64, 9 * 64, 3, 1, 1), nn.PixelShuffle(3)]
        self.upsample = nn.Sequential(*up)
        self.conv_last = nn.Conv2d(64, 3, 3, 1, 1)

    def forward(self, x):
        mean = self.mean.type_as(x)
        x = (x - mean) * self.img_range
        x = self.conv_first(x)
        res = x
        for layer in self.layers:
            res = layer(res)
        b, c, h, w = res.shape
        res = self.norm(res.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, c, h, w)
        x = self.conv_after_body(res) + x
        x = self.conv_last(self.upsample(self.conv_before_upsample(x)))
        return x / self.img_range + mean


# --------------------------------------------------------------------------- data
def read_img(path):
    img = cv2.imread(path, cv2.IMREAD_COLOR)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0


def to_tensor(img):
    return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))


class PairedImageDataset(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, patch_size=48, train=True, repeat=1):
        self.hr_paths = sorted(glob.glob(os.path.join(hr_dir, "*.png")))
        self.lr_paths = sorted(glob.glob(os.path.join(lr_dir, "*.png")))
        assert len(self.hr_paths) == len(self.lr_paths) > 0, (hr_dir, lr_dir)
        self.scale, self.patch_size, self.train, self.repeat = scale, patch_size, train, repeat

    def __len__(self):
        return len(self.hr_paths) * (self.repeat if self.train else 1)

    def __getitem__(self, idx):
        idx = idx % len(self.hr_paths)
        hr, lr, s = read_img(self.hr_paths[idx]), read_img(self.lr_paths[idx]), self.scale
        if self.train:
            p = self.patch_size
            top = random.randint(0, lr.shape[0] - p)
            left = random.randint(0, lr.shape[1] - p)
            lr = lr[top:top + p, left:left + p]
            hr = hr[top * s:(top + p) * s, left * s:(left + p) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr[::-1], hr[::-1]
            if random.random() < 0.5:
                lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        else:
            hr = hr[:lr.shape[0] * s, :lr.shape[1] * s]
        return {"lq": to_tensor(lr), "gt": to_tensor(hr)}


# --------------------------------------------------------------------------- metrics
def rgb_to_y(img):
    return (65.481 * img[:, 0] + 128.553 * img[:, 1] + 24.966 * img[:, 2]) + 16.0


def psnr_y(sr, gt, border):
    sr_y = rgb_to_y((sr.clamp(0, 1) * 255.0).round() / 255.0)
    gt_y = rgb_to_y(gt)
    if border:
        sr_y, gt_y = sr_y[..., border:-border, border:-border], gt_y[..., border:-border, border:-border]
    mse = ((sr_y - gt_y) ** 2).mean(dim=(-2, -1))
    return 10.0 * torch.log10(255.0 ** 2 / mse)


@torch.no_grad()
def validate(model, val_set, device, scale, rank, world_size):
    model.eval()
    window_size = model.window_size
    stats = torch.zeros(2, device=device)  # psnr sum, image count
    for i in range(rank, len(val_set), world_size):
        item = val_set[i]
        lq, gt = item["lq"].unsqueeze(0).to(device), item["gt"].unsqueeze(0).to(device)
        _, _, h, w = lq.shape
        pad_h = (window_size - h % window_size) % window_size
        pad_w = (window_size - w % window_size) % window_size
        lq = F.pad(lq, (0, pad_w, 0, pad_h), mode="reflect")
        sr = model(lq)[..., :h * scale, :w * scale]
        stats[0] += psnr_y(sr, gt, border=scale).sum()
        stats[1] += 1
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


# --------------------------------------------------------------------------- main
def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--val_root", default="/data/benchmark/Set14")
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--patch_size", type=int, default=48)
    p.add_argument("--batch_size", type=int, default=32, help="total over all GPUs")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--total_iters", type=int, default=500000)
    p.add_argument("--milestones", type=int, nargs="+", default=[250000, 400000, 450000, 475000])
    p.add_argument("--val_every", type=int, default=5000)
    p.add_argument("--save_every", type=int, default=5000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out_dir", default="experiments/swinir_x4")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=10)
    return p.parse_args()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)
    model = SwinIR(upscale=args.scale).to(device)
    random.seed(args.seed + rank)

    train_set = PairedImageDataset(os.path.join(args.data_root, "HR"),
                                   os.path.join(args.data_root, f"LR_bicubic/X{args.scale}"),
                                   args.scale, args.patch_size, train=True, repeat=20)
    val_set = PairedImageDataset(os.path.join(args.val_root, "HR"),
                                 os.path.join(args.val_root, f"LR_bicubic/X{args.scale}"),
                                 args.scale, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.5)
    start_iter = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_iter = ckpt["iter"]
        logger.info("resumed from %s at iter %d", args.resume, start_iter)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    it, epoch, best = start_iter, start_iter // len(loader), 0.0
    t0 = time.time()
    while it < args.total_iters:
        sampler.set_epoch(epoch)
        for batch in loader:
            it += 1
            lq = batch["lq"].to(device, non_blocking=True)
            gt = batch["gt"].to(device, non_blocking=True)
            loss = F.l1_loss(model(lq), gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if it % 100 == 0 and rank == 0:
                logger.info("iter %d/%d loss %.4f lr %.2e (%.2fs/100it)", it, args.total_iters, loss.item(),
                            scheduler.get_last_lr()[0], time.time() - t0)
                t0 = time.time()
            if it % args.val_every == 0:
                psnr = validate(model, val_set, device, args.scale, rank, world_size)
                if rank == 0:
                    logger.info("iter %d: val PSNR(Y) %.3f dB", it, psnr)
                    if psnr > best:
                        best = psnr
                        torch.save(model.module.state_dict(), os.path.join(args.out_dir, "net_g_best.pth"))
            if it % args.save_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "iter": it},
                           os.path.join(args.out_dir, f"ckpt_{it:07d}.pth"))
            if it >= args.total_iters:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out_dir, "net_g_latest.pth"))
        logger.info("done, best PSNR %.3f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
