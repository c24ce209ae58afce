"""Lightweight SwinIR (60 channels, 4 RSTB x 6 blocks, pixel-shuffle-direct upsampler) for x2/x3/x4.

Evaluates on the usual benchmarks with Y-channel PSNR / SSIM (MATLAB-style, via scikit-image).

    torchrun --nproc_per_node=4 20_swinir_light_benchmarks.py --scale 2 --epochs 500
"""
import argparse
import glob
import math
import os
import random
import time
from dataclasses import dataclass

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


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




class SwinIRLight(nn.Module):
    def __init__(self, upscale=2, embed_dim=60, depths=(6, 6, 6, 6), heads=(6, 6, 6, 6), window_size=8):
        super().__init__()
        self.upscale, self.window_size = upscale, window_size
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, embed_dim, 3, 1, 1)
        self.layers = nn.ModuleList([RSTB(embed_dim, d, h, window_size) for d, h in zip(depths, heads)])
        self.norm = nn.LayerNorm(embed_dim)
        self.conv_after_body = nn.Conv2d(embed_dim, embed_dim, 3, 1, 1)
        self.upsample = nn.Sequential(nn.Conv2d(embed_dim, 3 * upscale ** 2, 3, 1, 1), nn.PixelShuffle(upscale))

    def forward(self, x):
        h, w = x.shape[-2:]
        ws = self.window_size
        x = F.pad(x, (0, (-w) % ws, 0, (-h) % ws), mode="reflect")
        x = x - self.mean
        feat = self.conv_first(x)
        res = feat
        for layer in self.layers:
            res = layer(res)
        b, c, hh, ww = res.shape
        res = self.norm(res.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(b, c, hh, ww)
        out = self.upsample(self.conv_after_body(res) + feat) + self.mean
        return out[..., :h * self.upscale, :w * self.upscale]


@dataclass
class Config:
    train_hr: str = "/data/DIV2K/DIV2K_train_HR"
    bench_root: str = "/data/benchmark"
    benchmarks: tuple = ("Set5", "Set14", "B100", "Urban100", "Manga109")
    scale: int = 2
    lr_patch: int = 64
    batch_size: int = 64  # total
    epochs: int = 500
    lr: float = 2e-4
    milestones: tuple = (250, 400, 450, 475)
    out: str = "experiments/swinir_light"
    workers: int = 8


class DIV2KTrain(Dataset):
    def __init__(self, hr_dir, scale, lr_patch, repeat=40):
        self.hr = sorted(glob.glob(os.path.join(hr_dir, "*.png")))
        self.lr = [p.replace("_HR", f"_LR_bicubic/X{scale}").replace(".png", f"x{scale}.png") for p in self.hr]
        self.scale, self.p, self.repeat = scale, lr_patch, repeat

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, i):
        i %= len(self.hr)
        hr = cv2.cvtColor(cv2.imread(self.hr[i]), cv2.COLOR_BGR2RGB)
        lr = cv2.cvtColor(cv2.imread(self.lr[i]), cv2.COLOR_BGR2RGB)
        s, p = self.scale, self.p
        y, x = random.randint(0, lr.shape[0] - p), random.randint(0, lr.shape[1] - p)
        lr, hr = lr[y:y + p, x:x + p], hr[y * s:(y + p) * s, x * s:(x + p) * s]
        if random.random() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        if random.random() < 0.5:
            lr, hr = lr[::-1], hr[::-1]
        if random.random() < 0.5:
            lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return f(lr), f(hr)


def rgb2ycbcr_y(img_u8):
    img = img_u8.astype(np.float64)
    return np.dot(img, [65.481, 128.553, 24.966]) / 255.0 + 16.0


@torch.no_grad()
def eval_benchmark(net, cfg, name, device, rank, world):
    hr_files = sorted(glob.glob(os.path.join(cfg.bench_root, name, "HR", "*.png")))
    psnr_sum, ssim_sum, n = 0.0, 0.0, 0
    for k in range(rank, len(hr_files), world):
        hp = hr_files[k]
        lp = os.path.join(cfg.bench_root, name, "LR_bicubic", f"X{cfg.scale}",
                          os.path.basename(hp).replace(".png", f"x{cfg.scale}.png"))
        hr = cv2.cvtColor(cv2.imread(hp), cv2.COLOR_BGR2RGB)
        lr = cv2.cvtColor(cv2.imread(lp), cv2.COLOR_BGR2RGB)
        hr = hr[:lr.shape[0] * cfg.scale, :lr.shape[1] * cfg.scale]
        inp = torch.from_numpy(lr.transpose(2, 0, 1).copy()).float().div(255).unsqueeze(0).to(device)
        sr = net(inp)[0].clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).cpu().numpy()
        b = cfg.scale
        sr_y, hr_y = rgb2ycbcr_y(sr)[b:-b, b:-b], rgb2ycbcr_y(hr)[b:-b, b:-b]
        psnr_sum += peak_signal_noise_ratio(hr_y, sr_y, data_range=255)
        ssim_sum += structural_similarity(hr_y, sr_y, data_range=255, gaussian_weights=True, sigma=1.5,
                                          use_sample_covariance=False)
        n += 1
    stats = torch.tensor([psnr_sum, ssim_sum, n], dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--out", default="experiments/swinir_light")
    ap.add_argument("--resume", default="")
    cli = ap.parse_args()
    cfg = Config(scale=cli.scale, epochs=cli.epochs, out=f"{cli.out}_x{cli.scale}")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(0)
    net = SwinIRLight(upscale=cfg.scale).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, list(cfg.milestones), gamma=0.5)
    start_epoch = 0
    if cli.resume:
        ck = torch.load(cli.resume, map_location="cpu")
        net.load_state_dict(ck["net"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1
    model = DDP(net, device_ids=[local_rank])

    train_set = DIV2KTrain(cfg.train_hr, cfg.scale, cfg.lr_patch)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size // world, sampler=sampler,
                        num_workers=cfg.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, loss_acc = time.time(), 0.0
        for lr, hr in loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_acc += loss.item()
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch}: l1 {loss_acc / len(loader):.4f} lr {scheduler.get_last_lr()[0]:.1e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == cfg.epochs:
            net.eval()
            results = {b: eval_benchmark(net, cfg, b, device, rank, world) for b in cfg.benchmarks}
            net.train()
            if rank == 0:
                print(f"[epoch {epoch}] " + " | ".join(f"{b} {p:.2f}/{s:.4f}" for b, (p, s) in results.items()),
                      flush=True)
                torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch},
                           os.path.join(cfg.out, "last.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
