#!/usr/bin/env python
"""U-Net polyp segmentation (Kvasir-SEG) on Intel Arc / Max GPUs via IPEX + oneCCL.

    source /opt/intel/oneapi/setvars.sh
    torchrun --nproc_per_node=4 16_xpu_unet_polyp.py --root /data/kvasir-seg --out runs/unet_kvasir
"""
import argparse
import glob
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

import intel_extension_for_pytorch as ipex  # noqa: F401
import oneccl_bindings_for_pytorch  # noqa: F401


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="folder with images/, masks/ and split files")
    ap.add_argument("--out", default="runs/unet_kvasir")
    ap.add_argument("--size", type=int, default=352)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--base", type=int, default=32)
    return ap.parse_args()


class PolypSet(Dataset):
    def __init__(self, root, names, size, train):
        self.root, self.names, self.size, self.train = root, names, size, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        img = Image.open(os.path.join(self.root, "images", name)).convert("RGB").resize((self.size, self.size))
        msk = Image.open(os.path.join(self.root, "masks", name)).convert("L").resize((self.size, self.size),
                                                                                    Image.NEAREST)
        img = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        msk = torch.from_numpy((np.asarray(msk) > 127).astype(np.float32))[None]
        if self.train:
            if random.random() < 0.5:
                img, msk = img.flip(-1), msk.flip(-1)
            if random.random() < 0.5:
                img, msk = img.flip(-2), msk.flip(-2)
        img = (img - 0.5) / 0.25
        return img, msk


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, base=32):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8, base * 16]
        self.downs = nn.ModuleList()
        cin = 3
        for c in chs:
            self.downs.append(conv_block(cin, c))
            cin = c
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for c in reversed(chs[:-1]):
            self.ups.append(nn.ConvTranspose2d(c * 2, c, 2, stride=2))
            self.up_convs.append(conv_block(c * 2, c))
        self.out = nn.Conv2d(base, 1, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x)
            if i < len(self.downs) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips)):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def dice_bce(logits, target):
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2, 3))
    dice = 1 - (2 * inter + 1) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + 1)
    return bce + dice.mean()


@torch.no_grad()
def dice_score(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)  # sum of per-image dice, n images
    for img, msk in loader:
        img, msk = img.to(device), msk.to(device)
        pred = (torch.sigmoid(model(img)) > 0.5).float()
        inter = (pred * msk).sum((1, 2, 3))
        d = (2 * inter + 1e-6) / (pred.sum((1, 2, 3)) + msk.sum((1, 2, 3)) + 1e-6)
        acc[0] += d.sum()
        acc[1] += d.numel()
    model.train()
    return acc


def read_split(root, name):
    with open(os.path.join(root, f"{name}.txt")) as f:
        return [l.strip() for l in f if l.strip()]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.xpu.set_device(local_rank)
    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("xpu", local_rank)
    torch.manual_seed(42)

    train_names, val_names, test_names = (read_split(args.root, s) for s in ("train", "val", "test"))
    train_ds = PolypSet(args.root, train_names, args.size, train=True)
    val_ds = PolypSet(args.root, val_names, args.size, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=8, num_workers=2)

    model = DDP(UNet(args.base).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, msk in train_dl:
            img, msk = img.to(device, non_blocking=True), msk.to(device, non_blocking=True)
            with torch.autocast("xpu", dtype=torch.bfloat16):
                logits = model(img)
            loss = dice_bce(logits.float(), msk)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()

        stats = dice_score(model.module, val_dl, device)
        dist.all_reduce(stats)
        val_dice = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.4f} val dice {val_dice:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            if val_dice > best:
                best = val_dice
                torch.save({"model": model.state_dict(), "epoch": epoch, "dice": best}, best_path)
        dist.barrier()

    # final evaluation of the best checkpoint on the held-out test split
    if rank == 0:
        test_model = UNet(args.base).to(device)
        ckpt = torch.load(best_path, map_location=device)
        test_model.load_state_dict(ckpt["model"])
        test_dl = DataLoader(PolypSet(args.root, test_names, args.size, train=False), batch_size=8, num_workers=2)
        s = dice_score(test_model, test_dl, device)
        print(f"best epoch {ckpt['epoch']} val dice {ckpt['dice']:.4f} test dice {(s[0] / s[1]).item():.4f}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
