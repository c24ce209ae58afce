"""Restormer motion deblurring (RealBlur-J + GoPro mix), 256x256 crops.

Activation checkpointing on the transformer blocks lets us keep 8 crops per 40GB card.

    torchrun --nproc_per_node=8 12_restormer_motion_deblur.py --config configs/restormer_deblur.yml
"""
import argparse
import numbers
import os
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
import yaml
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


# ---------------------------------------------------------------------------- Restormer
class WithBiasLayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h, w = x.shape[-2:]
        x = rearrange(x, "b c h w -> b (h w) c")
        mu = x.mean(-1, keepdim=True)
        sigma = x.var(-1, keepdim=True, unbiased=False)
        x = (x - mu) / torch.sqrt(sigma + 1e-5) * self.weight + self.bias
        return rearrange(x, "b (h w) c -> b c h w", h=h, w=w)


class MDTA(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.ones(heads, 1, 1))
        self.qkv = nn.Conv2d(dim, dim * 3, 1, bias=False)
        self.qkv_dw = nn.Conv2d(dim * 3, dim * 3, 3, padding=1, groups=dim * 3, bias=False)
        self.project_out = nn.Conv2d(dim, dim, 1, bias=False)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv_dw(self.qkv(x)).chunk(3, dim=1)
        q = rearrange(q, "b (head c) h w -> b head c (h w)", head=self.heads)
        k = rearrange(k, "b (head c) h w -> b head c (h w)", head=self.heads)
        v = rearrange(v, "b (head c) h w -> b head c (h w)", head=self.heads)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * self.temperature
        out = attn.softmax(dim=-1) @ v
        out = rearrange(out, "b head c (h w) -> b (head c) h w", head=self.heads, h=h, w=w)
        return self.project_out(out)


class GDFN(nn.Module):
    def __init__(self, dim, expansion=2.66):
        super().__init__()
        hidden = int(dim * expansion)
        self.project_in = nn.Conv2d(dim, hidden * 2, 1, bias=False)
        self.dwconv = nn.Conv2d(hidden * 2, hidden * 2, 3, padding=1, groups=hidden * 2, bias=False)
        self.project_out = nn.Conv2d(hidden, dim, 1, bias=False)

    def forward(self, x):
        x1, x2 = self.dwconv(self.project_in(x)).chunk(2, dim=1)
        return self.project_out(F.gelu(x1) * x2)


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = WithBiasLayerNorm(dim), MDTA(dim, heads)
        self.norm2, self.ffn = WithBiasLayerNorm(dim), GDFN(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Stage(nn.Module):
    def __init__(self, dim, heads, depth, use_checkpoint):
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for blk in self.blocks:
            if self.use_checkpoint and self.training:
                x = cp.checkpoint(blk, x)
            else:
                x = blk(x)
        return x


class Restormer(nn.Module):
    def __init__(self, dim=48, blocks=(4, 6, 6, 8), heads=(1, 2, 4, 8), refinement=4, use_checkpoint=True):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 3, padding=1, bias=False)
        self.enc1 = Stage(dim, heads[0], blocks[0], use_checkpoint)
        self.down12 = nn.Sequential(nn.Conv2d(dim, dim // 2, 3, padding=1, bias=False), nn.PixelUnshuffle(2))
        self.enc2 = Stage(dim * 2, heads[1], blocks[1], use_checkpoint)
        self.down23 = nn.Sequential(nn.Conv2d(dim * 2, dim, 3, padding=1, bias=False), nn.PixelUnshuffle(2))
        self.enc3 = Stage(dim * 4, heads[2], blocks[2], use_checkpoint)
        self.down34 = nn.Sequential(nn.Conv2d(dim * 4, dim * 2, 3, padding=1, bias=False), nn.PixelUnshuffle(2))
        self.latent = Stage(dim * 8, heads[3], blocks[3], use_checkpoint)
        self.up43 = nn.Sequential(nn.Conv2d(dim * 8, dim * 16, 3, padding=1, bias=False), nn.PixelShuffle(2))
        self.reduce3 = nn.Conv2d(dim * 8, dim * 4, 1, bias=False)
        self.dec3 = Stage(dim * 4, heads[2], blocks[2], use_checkpoint)
        self.up32 = nn.Sequential(nn.Conv2d(dim * 4, dim * 8, 3, padding=1, bias=False), nn.PixelShuffle(2))
        self.reduce2 = nn.Conv2d(dim * 4, dim * 2, 1, bias=False)
        self.dec2 = Stage(dim * 2, heads[1], blocks[1], use_checkpoint)
        self.up21 = nn.Sequential(nn.Conv2d(dim * 2, dim * 4, 3, padding=1, bias=False), nn.PixelShuffle(2))
        self.dec1 = Stage(dim * 2, heads[0], blocks[0], use_checkpoint)
        self.refine = Stage(dim * 2, heads[0], refinement, use_checkpoint)
        self.output = nn.Conv2d(dim * 2, 3, 3, padding=1, bias=False)

    def forward(self, inp):
        e1 = self.enc1(self.patch_embed(inp))
        e2 = self.enc2(self.down12(e1))
        e3 = self.enc3(self.down23(e2))
        lat = self.latent(self.down34(e3))
        d3 = self.dec3(self.reduce3(torch.cat([self.up43(lat), e3], 1)))
        d2 = self.dec2(self.reduce2(torch.cat([self.up32(d3), e2], 1)))
        d1 = self.dec1(torch.cat([self.up21(d2), e1], 1))
        return self.output(self.refine(d1)) + inp


# ---------------------------------------------------------------------------- data
class DeblurPairs(Dataset):
    def __init__(self, list_file, crop=None):
        with open(list_file) as f:
            self.pairs = [line.split() for line in f if line.strip()]
        self.crop = crop

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        blur_p, sharp_p = self.pairs[i]
        blur = cv2.imread(blur_p)[:, :, ::-1].astype(np.float32) / 255.0
        sharp = cv2.imread(sharp_p)[:, :, ::-1].astype(np.float32) / 255.0
        if self.crop:
            h, w = blur.shape[:2]
            y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            blur, sharp = blur[y:y + self.crop, x:x + self.crop], sharp[y:y + self.crop, x:x + self.crop]
            k = random.randint(0, 3)
            blur, sharp = np.rot90(blur, k), np.rot90(sharp, k)
        else:
            # pad test images to a multiple of 8 for the three downsamplings
            h, w = blur.shape[:2]
            blur = np.pad(blur, ((0, (8 - h % 8) % 8), (0, (8 - w % 8) % 8), (0, 0)), mode="reflect")
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return f(blur), f(sharp)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(parser.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"] + rank)

    train_set = DeblurPairs(cfg["train_list"], crop=cfg["crop"])
    val_set = DeblurPairs(cfg["val_list"])
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1, num_workers=2)

    net = Restormer(use_checkpoint=cfg.get("use_checkpoint", True)).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.999), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, cfg["total_iters"], eta_min=1e-6)

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    it, epoch = 0, 0
    while it < cfg["total_iters"]:
        sampler.set_epoch(epoch)
        for blur, sharp in loader:
            blur, sharp = blur.to(device, non_blocking=True), sharp.to(device, non_blocking=True)
            loss = F.l1_loss(model(blur), sharp)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            optim.step()
            sched.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                print(f"it {it} l1 {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if it % cfg["val_freq"] == 0:
                net.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for blur_v, sharp_v in val_loader:
                        blur_v, sharp_v = blur_v.to(device), sharp_v.to(device)
                        h, w = sharp_v.shape[-2:]
                        out = net(blur_v)[..., :h, :w].clamp(0, 1)
                        out = torch.round(out * 255) / 255
                        acc[0] += 10 * torch.log10(1.0 / F.mse_loss(out.double(), sharp_v.double()))
                        acc[1] += 1
                net.train()
                dist.all_reduce(acc)
                if rank == 0:
                    print(f"[val] it {it} PSNR {(acc[0] / acc[1]).item():.3f} dB", flush=True)
                    torch.save({"params": net.state_dict(), "iter": it}, os.path.join(out_dir, f"restormer_{it}.pth"))
            if it >= cfg["total_iters"]:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
