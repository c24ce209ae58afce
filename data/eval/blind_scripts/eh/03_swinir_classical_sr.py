"""SwinIR classical SR (x2, DIV2K) -- medium-size config with activation checkpointing.

torchrun --nproc_per_node=8 03_swinir_classical_sr.py --train-hr /data/DIV2K/train_HR \
    --train-lr /data/DIV2K/train_LR_bicubic/X2 --val-hr /data/Set5/HR --val-lr /data/Set5/LR_bicubic/X2
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows, ws, h, w):
    b = int(windows.shape[0] / (h * w / ws / ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, -1)


class WindowAttention(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += ws - 1
        rel[:, :, 1] += ws - 1
        rel[:, :, 0] *= 2 * ws - 1
        self.register_buffer("relative_position_index", rel.sum(-1))
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1).unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(b_ // nw, nw, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b_, n, c)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, ws, shift, mlp_ratio=2.0):
        super().__init__()
        self.ws, self.shift = ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def attn_mask(self, h, w, device):
        img_mask = torch.zeros((1, h, w, 1), device=device)
        cnt = 0
        for hs in (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None)):
            for wsl in (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None)):
                img_mask[:, hs, wsl, :] = cnt
                cnt += 1
        mw = window_partition(img_mask, self.ws).view(-1, self.ws * self.ws)
        m = mw.unsqueeze(1) - mw.unsqueeze(2)
        return m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0)

    def forward(self, x, x_size):
        h, w = x_size
        b, _, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, h, w, c)
        mask = None
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
            mask = self.attn_mask(h, w, x.device)
        xw = window_partition(x, self.ws).view(-1, self.ws * self.ws, c)
        x = window_reverse(self.attn(xw, mask).view(-1, self.ws, self.ws, c), self.ws, h, w)
        if self.shift:
            x = torch.roll(x, (self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.reshape(b, h * w, c)
        return x + self.mlp(self.norm2(x))


class RSTB(nn.Module):
    def __init__(self, dim, depth, heads, ws, use_checkpoint):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.blocks = nn.ModuleList([SwinBlock(dim, heads, ws, 0 if i % 2 == 0 else ws // 2) for i in range(depth)])
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)

    def forward(self, x, x_size):
        res = x
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                x = checkpoint(blk, x, x_size, use_reentrant=False)
            else:
                x = blk(x, x_size)
        b, _, c = x.shape
        x = self.conv(x.transpose(1, 2).view(b, c, *x_size)).flatten(2).transpose(1, 2)
        return x + res


class SwinIR(nn.Module):
    def __init__(self, upscale=2, embed_dim=180, depths=(6,) * 6, heads=(6,) * 6, window_size=8,
                 use_checkpoint=False, img_range=1.0):
        super().__init__()
        self.window_size, self.upscale, self.img_range = window_size, upscale, img_range
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, embed_dim, 3, 1, 1)
        self.layers = nn.ModuleList([RSTB(embed_dim, d, h, window_size, use_checkpoint) for d, h in zip(depths, heads)])
        self.norm = nn.LayerNorm(embed_dim)
        self.conv_after_body = nn.Conv2d(embed_dim, embed_dim, 3, 1, 1)
        self.conv_before_upsample = nn.Sequential(nn.Conv2d(embed_dim, 64, 3, 1, 1), nn.LeakyReLU(inplace=True))
        ups = []
        for _ in range(int(math.log2(upscale))):
            ups += [nn.Conv2d(64, 4 * 64, 3, 1, 1), nn.PixelShuffle(2)]
        self.upsample = nn.Sequential(*ups)
        self.conv_last = nn.Conv2d(64, 3, 3, 1, 1)

    def forward(self, x):
        x = (x - self.mean) * self.img_range
        x = self.conv_first(x)
        b, c, h, w = x.shape
        feat = x.flatten(2).transpose(1, 2)
        for layer in self.layers:
            feat = layer(feat, (h, w))
        feat = self.norm(feat).transpose(1, 2).view(b, c, h, w)
        x = self.conv_after_body(feat) + x
        x = self.conv_last(self.upsample(self.conv_before_upsample(x)))
        return x / self.img_range + self.mean


class PairedDIV2K(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, lr_patch=None):
        self.hr = sorted(glob(os.path.join(hr_dir, "*.png")))
        self.lr = sorted(glob(os.path.join(lr_dir, "*.png")))
        assert len(self.hr) == len(self.lr), (len(self.hr), len(self.lr))
        self.scale, self.lr_patch = scale, lr_patch

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.cvtColor(cv2.imread(self.hr[i]), cv2.COLOR_BGR2RGB)
        lr = cv2.cvtColor(cv2.imread(self.lr[i]), cv2.COLOR_BGR2RGB)
        if self.lr_patch:
            p, s = self.lr_patch, self.scale
            y, x = random.randint(0, lr.shape[0] - p), random.randint(0, lr.shape[1] - p)
            lr, hr = lr[y:y + p, x:x + p], hr[y * s:(y + p) * s, x * s:(x + p) * s]
            k = random.randint(0, 7)
            if k & 1:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if k & 2:
                lr, hr = lr[::-1], hr[::-1]
            if k & 4:
                lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return t(lr), t(hr)


def y_psnr(sr, hr, border):
    coef = torch.tensor([65.481, 128.553, 24.966], device=sr.device, dtype=torch.float64).view(1, 3, 1, 1)
    sy = (sr.double() * coef).sum(1) / 255.0 + 16.0 / 255.0
    hy = (hr.double() * coef).sum(1) / 255.0 + 16.0 / 255.0
    sy, hy = sy[..., border:-border, border:-border], hy[..., border:-border, border:-border]
    return 10.0 * torch.log10(1.0 / torch.mean((sy - hy) ** 2))


@torch.no_grad()
def evaluate(model, val_set, rank, world, device, scale):
    net = model.module
    net.eval()
    ws = net.window_size
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for idx in range(rank, len(val_set), world):
        lr, hr = val_set[idx]
        lr, hr = lr.unsqueeze(0).to(device), hr.unsqueeze(0).to(device)
        _, _, h, w = lr.shape
        ph, pw = (ws - h % ws) % ws, (ws - w % ws) % ws
        lr_pad = torch.cat([lr, torch.flip(lr, [2])], 2)[:, :, :h + ph, :]
        lr_pad = torch.cat([lr_pad, torch.flip(lr_pad, [3])], 3)[:, :, :, :w + pw]
        sr = net(lr_pad)[..., :h * scale, :w * scale].clamp(0, 1)
        sr = torch.round(sr * 255.0) / 255.0
        total[0] += y_psnr(sr, hr, scale)
        total[1] += 1
    net.train()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-hr", required=True)
    ap.add_argument("--train-lr", required=True)
    ap.add_argument("--val-hr", required=True)
    ap.add_argument("--val-lr", required=True)
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32, help="total over all GPUs")
    ap.add_argument("--lr-patch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=500_000)
    ap.add_argument("--save-dir", default="./experiments/swinir_x2_m")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--grad-ckpt", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234)
    random.seed(1234 + rank)

    train_set = PairedDIV2K(args.train_hr, args.train_lr, args.scale, args.lr_patch)
    val_set = PairedDIV2K(args.val_hr, args.val_lr, args.scale)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = SwinIR(upscale=args.scale, use_checkpoint=args.grad_ckpt).to(device)
    optim = torch.optim.Adam(net.parameters(), lr=2e-4, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, [250_000, 400_000, 450_000, 475_000], gamma=0.5)
    step = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(state["net"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step = state["step"]
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    epoch = step // len(loader)
    while step < args.iters:
        sampler.set_epoch(epoch)
        for lr, hr in loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                writer.add_scalar("train/l1", loss.item(), step)
                print(f"[{step:07d}] l1={loss.item():.5f} lr={sched.get_last_lr()[0]:.2e}", flush=True)
            if step % 5000 == 0:
                psnr = evaluate(model, val_set, rank, world, device, args.scale)
                if rank == 0:
                    writer.add_scalar("val/psnr_y", psnr, step)
                    print(f"[{step:07d}] Set5 PSNR-Y {psnr:.3f}", flush=True)
                    torch.save({"net": model.module.state_dict(), "optim": optim.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.save_dir, f"swinir_{step:07d}.pth"))
            if step >= args.iters:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
