"""Binary segmentation (satellite building footprints) with a small U-Net.

Keras original: model.fit(..., callbacks=[ModelCheckpoint(save_best_only=True),
ReduceLROnPlateau(), CSVLogger()]). Same callback set here, DDP underneath.

    torchrun --nproc_per_node=4 05_unet_seg_callbacks.py --root /data/buildings --epochs 80
"""
import argparse
import csv
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class TileDataset(Dataset):
    def __init__(self, root, split, augment):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.png")))
        self.masks = [p.replace("/images/", "/masks/") for p in self.images]
        self.augment = augment

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = np.asarray(Image.open(self.images[i]).convert("RGB"), dtype=np.float32) / 255.0
        mask = (np.asarray(Image.open(self.masks[i]), dtype=np.uint8) > 127).astype(np.float32)
        img = torch.from_numpy(img).permute(2, 0, 1)
        mask = torch.from_numpy(mask)[None]
        if self.augment:
            if torch.rand(()) < 0.5:
                img, mask = img.flip(-1), mask.flip(-1)
            if torch.rand(()) < 0.5:
                img, mask = img.flip(-2), mask.flip(-2)
            k = int(torch.randint(0, 4, ()))
            img, mask = torch.rot90(img, k, (1, 2)), torch.rot90(mask, k, (1, 2))
        return img, mask


def double_conv(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, base=32):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8]
        self.downs = nn.ModuleList()
        cin = 3
        for c in chs:
            self.downs.append(double_conv(cin, c))
            cin = c
        self.bottleneck = double_conv(chs[-1], chs[-1] * 2)
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        cin = chs[-1] * 2
        for c in reversed(chs):
            self.ups.append(nn.ConvTranspose2d(cin, c, 2, stride=2))
            self.up_convs.append(double_conv(c * 2, c))
            cin = c
        self.head = nn.Conv2d(chs[0], 1, 1)

    def forward(self, x):
        skips = []
        for d in self.downs:
            x = d(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips)):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def dice_loss(logits, target, eps=1.0):
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2, 3))
    return 1 - ((2 * inter + eps) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + eps)).mean()


class ModelCheckpoint:
    def __init__(self, filepath, model, monitor="val_iou", mode="max", save_best_only=True):
        self.filepath, self.model, self.monitor = filepath, model, monitor
        self.mode, self.save_best_only = mode, save_best_only
        self.best = -float("inf") if mode == "max" else float("inf")

    def on_epoch_end(self, epoch, logs):
        current = logs[self.monitor]
        improved = current > self.best if self.mode == "max" else current < self.best
        if improved or not self.save_best_only:
            self.best = current if improved else self.best
            torch.save({"epoch": epoch, "state_dict": self.model.module.state_dict(), self.monitor: current},
                       self.filepath.format(epoch=epoch, **logs))


class ReduceLROnPlateau:
    def __init__(self, optimizer, monitor="val_loss", factor=0.5, patience=5, min_lr=1e-6):
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "min", factor, patience, min_lr=min_lr)
        self.monitor = monitor

    def on_epoch_end(self, epoch, logs):
        self.sched.step(logs[self.monitor])


class CSVLogger:
    def __init__(self, path):
        self.path = path

    def on_epoch_end(self, epoch, logs):
        header = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["epoch"] + sorted(logs))
            if header:
                w.writeheader()
            w.writerow({"epoch": epoch, **logs})


def reduce_sum(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="runs/unet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)  # different augmentations per replica; DDP syncs the initial weights
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    train_ds = TileDataset(args.root, "train", augment=True)
    val_ds = TileDataset(args.root, "val", augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 16, num_workers=4, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(UNet(base=32)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    bce = nn.BCEWithLogitsLoss()

    callbacks = [
        ModelCheckpoint(os.path.join(args.out, "unet_best.pt"), model, monitor="val_iou", mode="max"),
        ReduceLROnPlateau(opt, monitor="val_loss", factor=0.5, patience=5),
    ]
    if rank == 0:
        callbacks.append(CSVLogger(os.path.join(args.out, "log.csv")))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for img, mask in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = bce(logits, mask) + dice_loss(logits, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach() * img.size(0), torch.tensor(float(img.size(0)), device=device)])

        model.eval()
        stats = torch.zeros(4, device=device)  # loss_sum, n, intersection, union
        with torch.no_grad():
            for img, mask in val_dl:
                img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
                logits = model(img)
                pred = (logits > 0).float()
                stats[0] += (bce(logits, mask) + dice_loss(logits, mask)) * img.size(0)
                stats[1] += img.size(0)
                stats[2] += (pred * mask).sum()
                stats[3] += ((pred + mask) > 0).float().sum()
        run, stats = reduce_sum(run), reduce_sum(stats)
        logs = {"loss": (run[0] / run[1]).item(), "val_loss": (stats[0] / stats[1]).item(),
                "val_iou": (stats[2] / stats[3].clamp(min=1)).item(), "lr": opt.param_groups[0]["lr"]}
        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} " + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()),
                  flush=True)
        for cb in callbacks:
            cb.on_epoch_end(epoch, logs)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
