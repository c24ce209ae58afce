"""Building-footprint segmentation (SpaceNet / Inria tiles) with a U-Net (EfficientNet-B4 encoder).

    torchrun --nproc_per_node=8 19_unet_seg.py --data /data/inria_tiles --epochs 80 --batch-size 8
    # continue an interrupted run
    torchrun --nproc_per_node=8 19_unet_seg.py --data /data/inria_tiles --resume runs/unet_b4/last.pt
"""
import argparse
import glob
import os
import time

import albumentations as A
import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from albumentations.pytorch import ToTensorV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class TileDataset(Dataset):
    def __init__(self, root, split, transform):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.png")))
        self.masks = [p.replace("/images/", "/masks/") for p in self.images]
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.images[i]), cv2.COLOR_BGR2RGB)
        mask = (cv2.imread(self.masks[i], cv2.IMREAD_GRAYSCALE) > 127).astype(np.float32)
        out = self.transform(image=img, mask=mask)
        return out["image"], out["mask"].unsqueeze(0)


def transforms(train, size=512):
    norm = A.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    if train:
        return A.Compose([
            A.RandomResizedCrop(size, size, scale=(0.5, 1.0)),
            A.HorizontalFlip(), A.VerticalFlip(), A.RandomRotate90(),
            A.ShiftScaleRotate(shift_limit=0.05, scale_limit=0.1, rotate_limit=15, p=0.5),
            A.ColorJitter(0.2, 0.2, 0.2, 0.05, p=0.5),
            norm, ToTensorV2(),
        ])
    return A.Compose([A.PadIfNeeded(size, size), A.CenterCrop(size, size), norm, ToTensorV2()])


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--encoder", default="efficientnet-b4")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--out", default="runs/unet_b4")
    p.add_argument("--resume", default="")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    # tp, fp, fn summed over the whole shard, then over all ranks
    counts = torch.zeros(3, device=device, dtype=torch.float64)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            pred = (model(img).sigmoid() > 0.5).float()
        counts[0] += (pred * mask).sum()
        counts[1] += (pred * (1 - mask)).sum()
        counts[2] += ((1 - pred) * mask).sum()
    dist.all_reduce(counts)
    tp, fp, fn = counts.tolist()
    iou = tp / max(tp + fp + fn, 1.0)
    f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
    model.train()
    return iou, f1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_ds = TileDataset(args.data, "train", transforms(True))
    val_ds = TileDataset(args.data, "val", transforms(False))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world_size))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.batch_size,
                        num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights="imagenet", classes=1, decoder_attention_type="scse")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps_per_epoch = len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=steps_per_epoch,
                                                    pct_start=args.warmup_epochs / args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch, best_iou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_iou = ckpt["epoch"] + 1, ckpt["best_iou"]
        if rank == 0:
            print(f"resumed {args.resume} at epoch {start_epoch}, best IoU {best_iou:.4f}")

    model = DDP(model, device_ids=[local_rank])
    dice = smp.losses.DiceLoss("binary", from_logits=True)
    bce = nn.BCEWithLogitsLoss()

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for img, mask in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                logits = model(img)
                loss = dice(logits, mask) + bce(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        dist.all_reduce(running)
        val_iou, val_f1 = validate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {running[0] / running[1]:.4f} val IoU {val_iou:.4f} F1 {val_f1:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "best_iou": max(best_iou, val_iou), "encoder": args.encoder}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if val_iou > best_iou:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        best_iou = max(best_iou, val_iou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
