"""DeepLabV3+ (segmentation_models_pytorch, EfficientNet-B4) on our UAV scene dataset.

The dataset ships as one folder of tiles without an official split, so we hold
out a fixed fraction for validation.

    torchrun --nproc_per_node=4 15_uav_smp_deeplab_split.py --data-root /data/uav_scenes_v3
"""
import argparse
import glob
import os
import random
import time

import albumentations as A
import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["background", "building", "road", "tree", "low_vegetation", "car", "water", "clutter"]
IGNORE = 255


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--out", default="runs/uav_dlv3p_effb4")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TileDataset(Dataset):
    def __init__(self, pairs, transform):
        self.pairs = pairs
        self.transform = transform

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        img_p, mask_p = self.pairs[i]
        img = cv2.cvtColor(cv2.imread(img_p), cv2.COLOR_BGR2RGB)
        mask = cv2.imread(mask_p, cv2.IMREAD_GRAYSCALE)
        out = self.transform(image=img, mask=mask)
        img = torch.from_numpy(out["image"].transpose(2, 0, 1).copy()).float()
        return img, torch.from_numpy(out["mask"].astype(np.int64))


def build_transforms(crop):
    norm = A.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    train_tf = A.Compose([
        A.RandomScale(scale_limit=(-0.5, 1.0), p=1.0),
        A.PadIfNeeded(crop, crop, border_mode=cv2.BORDER_CONSTANT, value=0, mask_value=IGNORE),
        A.RandomCrop(crop, crop),
        A.HorizontalFlip(p=0.5),
        A.VerticalFlip(p=0.5),
        A.RandomRotate90(p=0.5),
        A.ColorJitter(0.2, 0.2, 0.2, 0.05, p=0.5),
        norm,
    ])
    val_tf = A.Compose([norm])
    return train_tf, val_tf


def list_pairs(root):
    imgs = sorted(glob.glob(os.path.join(root, "images", "*.png")))
    return [(p, os.path.join(root, "masks", os.path.basename(p))) for p in imgs]


@torch.no_grad()
def evaluate(net, loader, n, device):
    net.eval()
    hist = torch.zeros(n, n, dtype=torch.int64, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = net(img).argmax(1)
        k = mask != IGNORE
        hist += torch.bincount(mask[k] * n + pred[k], minlength=n * n).view(n, n)
    dist.all_reduce(hist)
    h = hist.double()
    net.train()
    return h.diag() / (h.sum(0) + h.sum(1) - h.diag())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on every rank
    seed_everything(args.seed + rank)

    pairs = list_pairs(args.data_root)
    random.shuffle(pairs)
    n_val = int(len(pairs) * args.val_frac)
    val_pairs, train_pairs = pairs[:n_val], pairs[n_val:]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_pairs)} train / {len(val_pairs)} val tiles, {world} GPUs", flush=True)

    train_tf, val_tf = build_transforms(args.crop)
    train_ds = TileDataset(train_pairs, train_tf)
    val_ds = TileDataset(val_pairs, val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=2)

    net = smp.DeepLabV3Plus(encoder_name="efficientnet-b4", encoder_weights="imagenet",
                            classes=len(CLASSES), encoder_output_stride=16)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": net.encoder.parameters(), "lr": args.lr * 0.1},
        {"params": list(net.decoder.parameters()) + list(net.segmentation_head.parameters()), "lr": args.lr},
    ], weight_decay=1e-4)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=total_steps, power=0.9)
    dice = smp.losses.DiceLoss("multiclass", ignore_index=IGNORE)
    ce = nn.CrossEntropyLoss(ignore_index=IGNORE)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for img, mask in loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = ce(logits, mask) + 0.5 * dice(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.tensor(1.0, device=device)])
        dist.all_reduce(running)

        iou = evaluate(net, val_loader, len(CLASSES), device)
        miou = torch.nanmean(iou).item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {(running[0] / running[1]).item():.4f} "
                  f"val mIoU {100 * miou:.2f} ({time.time() - t0:.0f}s)", flush=True)
            print("   " + ", ".join(f"{c}={100 * v:.1f}" for c, v in zip(CLASSES, iou.tolist())), flush=True)
            state = {"epoch": epoch + 1, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict()}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if miou > best:
                best = miou
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
