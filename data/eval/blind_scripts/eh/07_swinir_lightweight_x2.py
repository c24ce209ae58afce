"""SwinIR-light x2 for the on-device zoom pipeline (pixelshuffledirect head, ~0.9M params).

AdamW + cosine, Swin-style parameter groups (no decay on norms, biases and relative position tables).

    torchrun --nproc_per_node=4 07_swinir_lightweight_x2.py --cfg cfg/swinir_light_x2.yaml
"""
import argparse
import math
import os
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def to_windows(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, c)


def from_windows(win, ws, b, h, w):
    x = win.view(b, h // ws, w // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, -1)


class WindowMSA(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        ys, xs = torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")
        c = torch.stack([ys.flatten(), xs.flatten()])
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * ws - 1) + rel[..., 1])
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x, mask):
        bw, n, c = x.shape
        q, k, v = self.qkv(x).view(bw, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        rpb = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        attn = attn + rpb.view(n, n, -1).permute(2, 0, 1)[None]
        if mask is not None:
            nw = mask.shape[0]
            attn = (attn.view(-1, nw, self.heads, n, n) + mask[None, :, None]).view(bw, self.heads, n, n)
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(bw, n, c)
        return self.proj(out)


class SwinLayer(nn.Module):
    def __init__(self, dim, heads, ws, shift):
        super().__init__()
        self.ws, self.shift = ws, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowMSA(dim, ws, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def _mask(self, h, w, device):
        m = torch.zeros(1, h, w, 1, device=device)
        regions = (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None))
        for i, hs in enumerate(regions):
            for j, wsl in enumerate(regions):
                m[:, hs, wsl] = i * 3 + j
        mw = to_windows(m, self.ws).squeeze(-1)
        diff = mw[:, None, :] - mw[:, :, None]
        return diff.ne(0).float() * -100.0

    def forward(self, x, hw):
        h, w = hw
        b, _, c = x.shape
        y = self.norm1(x).view(b, h, w, c)
        mask = None
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
            mask = self._mask(h, w, x.device)
        y = from_windows(self.attn(to_windows(y, self.ws), mask), self.ws, b, h, w)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y.reshape(b, h * w, c)
        return x + self.mlp(self.norm2(x))


class RSTB(nn.Module):
    def __init__(self, dim, depth, heads, ws):
        super().__init__()
        self.layers = nn.ModuleList(SwinLayer(dim, heads, ws, (i % 2) * (ws // 2)) for i in range(depth))
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)

    def forward(self, x, hw):
        y = x
        for layer in self.layers:
            y = layer(y, hw)
        b, _, c = y.shape
        y = self.conv(y.transpose(1, 2).reshape(b, c, *hw)).flatten(2).transpose(1, 2)
        return x + y


class SwinIRLight(nn.Module):
    def __init__(self, upscale=2, dim=60, depths=(6, 6, 6, 6), heads=6, window_size=8):
        super().__init__()
        self.upscale, self.window_size = upscale, window_size
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, dim, 3, 1, 1)
        self.blocks = nn.ModuleList(RSTB(dim, d, heads, window_size) for d in depths)
        self.norm = nn.LayerNorm(dim)
        self.conv_after_body = nn.Conv2d(dim, dim, 3, 1, 1)
        self.upsample = nn.Sequential(nn.Conv2d(dim, 3 * upscale ** 2, 3, 1, 1), nn.PixelShuffle(upscale))

    def no_weight_decay(self):
        return {"absolute_pos_embed"}

    def no_weight_decay_keywords(self):
        return {"relative_position_bias_table"}

    def forward(self, x):
        x = x - self.mean
        feat = self.conv_first(x)
        b, c, h, w = feat.shape
        t = feat.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            t = blk(t, (h, w))
        t = self.norm(t).transpose(1, 2).reshape(b, c, h, w)
        out = self.upsample(self.conv_after_body(t) + feat)
        return out + self.mean


def build_param_groups(model, weight_decay):
    skip, skip_keywords = set(), set()
    if hasattr(model, "no_weight_decay"):
        skip = model.no_weight_decay()
    if hasattr(model, "no_weight_decay_keywords"):
        skip_keywords = model.no_weight_decay_keywords()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 1 or name.endswith(".bias") or name in skip or any(k in name for k in skip_keywords):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class PairedFolder(Dataset):
    def __init__(self, hr_glob, lr_dir, scale, lr_patch=None):
        self.hr = sorted(glob(hr_glob))
        self.lr = [os.path.join(lr_dir, os.path.basename(p)) for p in self.hr]
        self.scale, self.lr_patch = scale, lr_patch

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.imread(self.hr[i], cv2.IMREAD_UNCHANGED)[..., :3][..., ::-1]
        lr = cv2.imread(self.lr[i], cv2.IMREAD_UNCHANGED)[..., :3][..., ::-1]
        if self.lr_patch:
            p, s = self.lr_patch, self.scale
            y, x = np.random.randint(0, lr.shape[0] - p + 1), np.random.randint(0, lr.shape[1] - p + 1)
            lr, hr = lr[y:y + p, x:x + p], hr[y * s:(y + p) * s, x * s:(x + p) * s]
            if np.random.rand() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if np.random.rand() < 0.5:
                lr, hr = np.rot90(lr), np.rot90(hr)
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a).transpose(2, 0, 1).copy()).float().div(255.0)
        return f(lr), f(hr)


def psnr_y(sr, hr, shave):
    k = sr.new_tensor([65.481, 128.553, 24.966]).view(1, 3, 1, 1) / 255.0
    d = ((sr - hr) * k).sum(1)[..., shave:-shave, shave:-shave]
    return -10.0 * torch.log10(d.double().pow(2).mean())


def seed_worker(worker_id):
    s = torch.initial_seed() % 2 ** 32
    np.random.seed(s)
    random.seed(s)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(parser.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    scale = cfg["scale"]
    train_ds = PairedFolder(cfg["train_hr_glob"], cfg["train_lr_dir"], scale, cfg["lr_patch"])
    val_ds = PairedFolder(cfg["val_hr_glob"], cfg["val_lr_dir"], scale)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, worker_init_fn=seed_worker)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=2)

    model = SwinIRLight(upscale=scale).to(dev)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(build_param_groups(model, cfg["weight_decay"]), lr=cfg["lr"], betas=(0.9, 0.99))
    total = cfg["epochs"] * len(loader)
    warmup = cfg.get("warmup_iters", 2000)
    lr_lambda = lambda it: min(1.0, (it + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(it, total) / total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (lr_img, hr_img) in enumerate(loader):
            lr_img, hr_img = lr_img.to(dev, non_blocking=True), hr_img.to(dev, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} l1 {loss.item():.5f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        if (epoch + 1) % cfg.get("val_every", 5) == 0:
            net = model.module
            net.eval()
            ws = net.window_size
            acc = torch.zeros(2, device=dev, dtype=torch.float64)
            with torch.no_grad():
                for lr_img, hr_img in val_loader:
                    lr_img, hr_img = lr_img.to(dev), hr_img.to(dev)
                    h, w = lr_img.shape[-2:]
                    lr_pad = F.pad(lr_img, (0, (ws - w % ws) % ws, 0, (ws - h % ws) % ws), mode="reflect")
                    sr = net(lr_pad)[..., : h * scale, : w * scale].clamp(0, 1)
                    acc[0] += psnr_y(torch.round(sr * 255) / 255, hr_img, scale)
                    acc[1] += 1
            dist.all_reduce(acc)
            psnr = (acc[0] / acc[1]).item()
            if rank == 0:
                print(f"[val] epoch {epoch} PSNR-Y {psnr:.3f}", flush=True)
                torch.save(net.state_dict(), os.path.join(out_dir, "last.pth"))
                if psnr > best:
                    best = psnr
                    torch.save(net.state_dict(), os.path.join(out_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
