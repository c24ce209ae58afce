"""
Binary segmentation (Carvana-style masks) with a small U-Net, data parallel
by hand: rank 0 picks the run name and initial weights and broadcasts them,
gradients are averaged with all_reduce every step.

    torchrun --nproc_per_node=4 13_unet_seg_run_broadcast.py --images data/train --masks data/train_masks
"""
import argparse
import datetime
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--images", required=True)
    p.add_argument("--masks", required=True)
    p.add_argument("--runs", default="runs/unet")
    p.add_argument("--size", type=int, nargs=2, default=[512, 768])
    p.add_argument("--base", type=int, default=32)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--val-every", type=int, default=1)
    return p.parse_args()


class CarvanaDataset(Dataset):
    def __init__(self, image_paths, mask_dir, size, train):
        self.image_paths = image_paths
        self.mask_dir = mask_dir
        self.size = tuple(size)
        self.train = train

    def __len__(self):
        return len(self.image_paths)

    def __getitem__(self, i):
        path = self.image_paths[i]
        stem = os.path.splitext(os.path.basename(path))[0]
        img = Image.open(path).convert("RGB").resize(self.size[::-1], Image.BILINEAR)
        mask = Image.open(os.path.join(self.mask_dir, stem + "_mask.gif")).resize(self.size[::-1], Image.NEAREST)
        img = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mask = torch.from_numpy((np.asarray(mask) > 0).astype(np.float32))[None]
        if self.train and torch.rand(1).item() < 0.5:
            img, mask = img.flip(-1), mask.flip(-1)
        return img, mask


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, base=32):
        super().__init__()
        ch = [base, base * 2, base * 4, base * 8, base * 16]
        self.downs = nn.ModuleList()
        cin = 3
        for c in ch:
            self.downs.append(conv_block(cin, c))
            cin = c
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for c in reversed(ch[:-1]):
            self.ups.append(nn.ConvTranspose2d(cin, c, 2, stride=2))
            self.up_convs.append(conv_block(2 * c, c))
            cin = c
        self.head = nn.Conv2d(cin, 1, 1)

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.downs):
            x = d(x)
            if i < len(self.downs) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, conv, s in zip(self.ups, self.up_convs, reversed(skips)):
            x = conv(torch.cat([up(x), s], dim=1))
        return self.head(x)


def dice_loss(logits, target, eps=1.0):
    p = torch.sigmoid(logits)
    num = 2 * (p * target).sum(dim=(1, 2, 3)) + eps
    den = p.sum(dim=(1, 2, 3)) + target.sum(dim=(1, 2, 3)) + eps
    return 1 - (num / den).mean()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    # one run folder for the whole job, named by rank 0
    run_name = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S") if rank == 0 else None]
    dist.broadcast_object_list(run_name, src=0)
    run_dir = os.path.join(args.runs, run_name[0])

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    paths = sorted(glob.glob(os.path.join(args.images, "*.jpg")))
    cars = sorted({os.path.basename(p).split("_")[0] for p in paths})
    val_cars = set(cars[: len(cars) // 10])  # split by car id, same on every rank
    train_paths = [p for p in paths if os.path.basename(p).split("_")[0] not in val_cars]
    val_paths = [p for p in paths if os.path.basename(p).split("_")[0] in val_cars]
    train_ds = CarvanaDataset(train_paths, args.masks, args.size, train=True)
    val_ds = CarvanaDataset(val_paths, args.masks, args.size, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world))),
                        batch_size=args.batch_size, num_workers=4)

    model = UNet(args.base).to(device)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        print(f"run dir {run_dir}: {len(train_ds)} train / {len(val_ds)} val images", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, mask) in enumerate(train_dl):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            logits = logits.float()
            loss = F.binary_cross_entropy_with_logits(logits, mask) + dice_loss(logits, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            opt.step()
            sched.step()
            if rank == 0 and it % 25 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            inter_union = torch.zeros(2, device=device, dtype=torch.float64)
            with torch.no_grad():
                for img, mask in val_dl:
                    img, mask = img.to(device), mask.to(device)
                    pred = (model(img) > 0).float()
                    inter_union[0] += (pred * mask).sum()
                    inter_union[1] += pred.sum() + mask.sum()
            dist.all_reduce(inter_union)
            dice = (2 * inter_union[0] / inter_union[1].clamp(min=1)).item()
            if rank == 0:
                print(f"epoch {epoch} val dice {dice:.4f} ({time.time() - t0:.0f}s)", flush=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "dice": dice},
                           os.path.join(run_dir, f"unet_ep{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
