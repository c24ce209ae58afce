"""Learned ISP: phone RAW (RGGB DNG) -> DSLR-quality sRGB, trained on our aligned capture rig pairs.

Patches are cut once from the full-resolution pairs and cached as .npz next to the dataset.

    torchrun --nproc_per_node=8 06_raw2rgb_isp_net.py --raw-dir /nas/isp/pairs/raw \
        --rgb-dir /nas/isp/pairs/dslr_aligned --cache-dir /nas/isp/cache/p448
"""
import argparse
import json
import os
import random

import cv2
import numpy as np
import rawpy
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


# --------------------------------------------------------------------------- raw handling
def pack_bayer(raw, black, white):
    """RGGB mosaic (H, W) -> normalised (H/2, W/2, 4)."""
    raw = (raw.astype(np.float32) - black) / (white - black)
    raw = np.clip(raw, 0.0, 1.0)
    return np.stack([raw[0::2, 0::2], raw[0::2, 1::2], raw[1::2, 0::2], raw[1::2, 1::2]], axis=-1)


def read_dng(path):
    with rawpy.imread(path) as r:
        raw = r.raw_image_visible.copy()
        black = float(np.mean(r.black_level_per_channel))
        white = float(r.white_level)
    return pack_bayer(raw, black, white)


def build_patch_cache(raw_dir, rgb_dir, cache_dir, patch=448, val_every=20):
    """Cut aligned RAW/RGB pairs into patches; returns the index (list of dicts)."""
    index_file = os.path.join(cache_dir, "index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            return json.load(f)
    os.makedirs(cache_dir, exist_ok=True)
    entries = []
    stems = sorted(os.path.splitext(n)[0] for n in os.listdir(raw_dir) if n.lower().endswith(".dng"))
    for k, stem in enumerate(tqdm(stems, desc="caching patches")):
        packed = read_dng(os.path.join(raw_dir, stem + ".dng"))
        rgb = cv2.imread(os.path.join(rgb_dir, stem + ".png"), cv2.IMREAD_COLOR)[:, :, ::-1]
        rgb = rgb.astype(np.float32) / 255.0
        hp = patch // 2
        split = "val" if k % val_every == 0 else "train"
        for y in range(0, packed.shape[0] - hp + 1, hp):
            for x in range(0, packed.shape[1] - hp + 1, hp):
                out = os.path.join(cache_dir, f"{stem}_{y:05d}_{x:05d}.npz")
                np.savez(out, raw=packed[y:y + hp, x:x + hp].astype(np.float16),
                         rgb=rgb[2 * y:2 * y + patch, 2 * x:2 * x + patch].astype(np.float16))
                entries.append({"file": out, "split": split})
    with open(index_file, "w") as f:
        json.dump(entries, f)
    return entries


class RawRGBPatches(Dataset):
    def __init__(self, entries, split, augment):
        self.files = [e["file"] for e in entries if e["split"] == split]
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        raw, rgb = d["raw"].astype(np.float32), d["rgb"].astype(np.float32)
        if self.augment and random.random() < 0.5:
            # flip on the packed grid: each 2x2 block keeps its RGGB order
            raw, rgb = raw[:, ::-1], rgb[:, ::-1]
        raw = torch.from_numpy(np.ascontiguousarray(raw.transpose(2, 0, 1)))
        rgb = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))
        return raw, rgb


# --------------------------------------------------------------------------- network
def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.LeakyReLU(0.2, True),
                         nn.Conv2d(cout, cout, 3, 1, 1), nn.LeakyReLU(0.2, True))


class ISPNet(nn.Module):
    """UNet on the packed 4-channel RAW, PixelShuffle x2 to full-resolution RGB."""

    def __init__(self, base=32):
        super().__init__()
        self.enc1 = conv_block(4, base)
        self.enc2 = conv_block(base, base * 2)
        self.enc3 = conv_block(base * 2, base * 4)
        self.enc4 = conv_block(base * 4, base * 8)
        self.pool = nn.MaxPool2d(2)
        self.up3 = nn.ConvTranspose2d(base * 8, base * 4, 2, 2)
        self.dec3 = conv_block(base * 8, base * 4)
        self.up2 = nn.ConvTranspose2d(base * 4, base * 2, 2, 2)
        self.dec2 = conv_block(base * 4, base * 2)
        self.up1 = nn.ConvTranspose2d(base * 2, base, 2, 2)
        self.dec1 = conv_block(base * 2, base)
        self.to_rgb = nn.Sequential(nn.Conv2d(base, 12, 1), nn.PixelShuffle(2))

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        e4 = self.enc4(self.pool(e3))
        d3 = self.dec3(torch.cat([self.up3(e4), e3], 1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return torch.sigmoid(self.to_rgb(d1))


def ssim_loss(x, y):
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mu_x, mu_y = F.avg_pool2d(x, 7, 1, 3), F.avg_pool2d(y, 7, 1, 3)
    sxx = F.avg_pool2d(x * x, 7, 1, 3) - mu_x ** 2
    syy = F.avg_pool2d(y * y, 7, 1, 3) - mu_y ** 2
    sxy = F.avg_pool2d(x * y, 7, 1, 3) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return 1.0 - s.mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw-dir", required=True)
    ap.add_argument("--rgb-dir", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", default="runs/ispnet_v3")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--w-ssim", type=float, default=0.15)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    random.seed(42 + rank)

    entries = build_patch_cache(args.raw_dir, args.rgb_dir, args.cache_dir)
    train_set = RawRGBPatches(entries, "train", augment=True)
    val_set = RawRGBPatches(entries, "val", augment=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=4, num_workers=4)

    net = ISPNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader), eta_min=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train / {len(val_set)} val patches, {world} GPUs", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (raw, rgb) in enumerate(train_loader):
            raw, rgb = raw.to(device, non_blocking=True), rgb.to(device, non_blocking=True)
            out = model(raw)
            loss = F.l1_loss(out, rgb) + args.w_ssim * ssim_loss(out, rgb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} it {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        net.eval()
        sums = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for raw, rgb in val_loader:
                raw, rgb = raw.to(device), rgb.to(device)
                out = net(raw).clamp(0, 1)
                mse = ((out - rgb) ** 2).flatten(1).mean(1).double()
                sums[0] += (10 * torch.log10(1.0 / mse)).sum()
                sums[1] += (1.0 - ssim_loss(out, rgb)).double() * raw.shape[0]
                sums[2] += raw.shape[0]
        dist.all_reduce(sums)
        psnr, ssim = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
        if rank == 0:
            print(f"== epoch {epoch}: val PSNR {psnr:.3f}  SSIM {ssim:.4f}", flush=True)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if psnr > best:
                best = psnr
                torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
