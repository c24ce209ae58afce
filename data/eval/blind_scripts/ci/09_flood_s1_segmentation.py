"""Flood-water segmentation from Sentinel-1 (Sen1Floods11 hand-labelled chips).

Chips are 512x512, VV/VH backscatter in dB; labels: -1 no data, 0 dry, 1 water.
Many chips are mostly no-data (swath edges, masked clouds in the reference S2),
so weakly labelled batches are not worth a step.

    torchrun --nproc_per_node=4 09_flood_s1_segmentation.py \
        --data /shared/sen1floods11/v1.1/data/flood_events/HandLabeled \
        --splits /shared/sen1floods11/v1.1/splits/flood_handlabeled
"""
import argparse
import csv
import logging
import os
import sys

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

S1_MEAN = np.array([-11.27, -18.43], dtype=np.float32)
S1_STD = np.array([3.62, 3.93], dtype=np.float32)

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Sen1Floods11 S1 water segmentation")
    parser.add_argument("--data", required=True)
    parser.add_argument("--splits", required=True)
    parser.add_argument("--output", default="/shared/sen1floods11/runs/s1_unet")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--crop", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--min-valid-fraction", type=float, default=0.05)
    parser.add_argument("--water-weight", type=float, default=3.0)
    return parser.parse_args()


def read_split(splits_dir, name):
    with open(os.path.join(splits_dir, f"flood_{name}_data.csv")) as f:
        return [row[0].replace("_S1Hand.tif", "") for row in csv.reader(f) if row]


class Sen1Floods11(Dataset):
    def __init__(self, root, chip_ids, crop=None):
        self.root, self.chip_ids, self.crop = root, chip_ids, crop

    def __len__(self):
        return len(self.chip_ids)

    def __getitem__(self, i):
        cid = self.chip_ids[i]
        with rasterio.open(os.path.join(self.root, "S1Hand", f"{cid}_S1Hand.tif")) as src:
            x = src.read().astype(np.float32)
        with rasterio.open(os.path.join(self.root, "LabelHand", f"{cid}_LabelHand.tif")) as src:
            y = src.read(1).astype(np.int64)
        x = np.nan_to_num(x, nan=-30.0)
        x = (np.clip(x, -30, 5) - S1_MEAN[:, None, None]) / S1_STD[:, None, None]
        if self.crop:
            h, w = y.shape
            r = np.random.randint(0, h - self.crop + 1)
            c = np.random.randint(0, w - self.crop + 1)
            x, y = x[:, r:r + self.crop, c:c + self.crop], y[r:r + self.crop, c:c + self.crop]
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if np.random.rand() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def water_iou(cm):
    # cm = [tp, fp, fn]
    return (cm[0] / (cm[0] + cm[1] + cm[2]).clamp(min=1)).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    cm = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x).argmax(1)
        valid = y >= 0
        p, t = pred[valid] == 1, y[valid] == 1
        cm += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
    dist.all_reduce(cm)
    return water_iou(cm)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, format=f"[rank{rank}] %(asctime)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)

    train_ids = read_split(args.splits, "train")
    val_ids = read_split(args.splits, "valid")
    train_ds = Sen1Floods11(args.data, train_ids, crop=args.crop)
    val_ds = Sen1Floods11(args.data, val_ids)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_shard = list(range(len(val_ds)))[rank::world_size]
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_shard), batch_size=4, num_workers=4)
    logger.info("train chips %d, val chips %d", len(train_ds), len(val_ds))

    model = smp.Unet("resnet34", encoder_weights=None, in_channels=2, classes=2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * world_size * args.batch_size / 32     # --lr is for 32 chips per step
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10)
    class_w = torch.tensor([1.0, args.water_weight], device=device)
    criterion = nn.CrossEntropyLoss(weight=class_w, ignore_index=-1)
    min_valid = int(args.min_valid_fraction * args.batch_size * args.crop * args.crop)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        n_steps, loss_acc = 0, torch.zeros((), device=device)
        for i, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if (y >= 0).sum() < min_valid:
                continue
            logits = model(x)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step(epoch + i / len(train_loader))
            loss_acc += loss.detach()
            n_steps += 1
        stats = torch.tensor([loss_acc.item(), n_steps], device=device, dtype=torch.float64)
        dist.all_reduce(stats)
        train_loss = (stats[0] / stats[1].clamp(min=1)).item()

        iou = evaluate(model.module, val_loader, device)
        logger.info("epoch %d train loss %.4f val water IoU %.4f", epoch, train_loss, iou)
        if rank == 0:
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "iou": iou}
            torch.save(state, os.path.join(args.output, "last.pt"))
            if iou > best:
                best = iou
                torch.save(state, os.path.join(args.output, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
