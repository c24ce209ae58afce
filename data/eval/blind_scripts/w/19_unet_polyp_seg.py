"""
Polyp segmentation (Kvasir-SEG) with a U-Net / ResNet34 encoder from segmentation_models_pytorch.
Multi-GPU DDP with SyncBatchNorm (batch per GPU is small at 352x352).

    torchrun --nproc_per_node=4 19_unet_polyp_seg.py --data_root data/Kvasir-SEG --epochs 80
    # resume: same command + --resume
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
from tqdm import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="data/Kvasir-SEG")
    p.add_argument("--size", type=int, default=352)
    p.add_argument("--encoder", default="resnet34")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ckpt_dir", default="ckpt_unet")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class PolypDataset(Dataset):
    def __init__(self, image_paths, root, transform):
        self.images = image_paths
        self.root = root
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.images[i]), cv2.COLOR_BGR2RGB)
        mask_path = os.path.join(self.root, "masks", os.path.basename(self.images[i]))
        mask = (cv2.imread(mask_path, cv2.IMREAD_GRAYSCALE) > 127).astype(np.float32)
        out = self.transform(image=img, mask=mask)
        return out["image"], out["mask"].unsqueeze(0)


def get_transforms(size):
    norm = A.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    train = A.Compose([
        A.Resize(size, size),
        A.HorizontalFlip(p=0.5),
        A.VerticalFlip(p=0.5),
        A.RandomRotate90(p=0.5),
        A.ColorJitter(0.2, 0.2, 0.1, 0.02, p=0.5),
        norm,
        ToTensorV2(),
    ])
    val = A.Compose([A.Resize(size, size), norm, ToTensorV2()])
    return train, val


def dice_iou_sums(logits, target, eps=1e-6):
    pred = (torch.sigmoid(logits) > 0.5).float()
    inter = (pred * target).sum(dim=(1, 2, 3))
    union = pred.sum(dim=(1, 2, 3)) + target.sum(dim=(1, 2, 3))
    dice = (2 * inter + eps) / (union + eps)
    iou = (inter + eps) / (union - inter + eps)
    return dice.sum(), iou.sum()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    images = sorted(glob.glob(os.path.join(args.data_root, "images", "*.jpg")))
    rng = np.random.RandomState(42)
    idx = rng.permutation(len(images))
    n_val = len(images) // 10
    val_imgs = [images[i] for i in idx[:n_val]]
    train_imgs = [images[i] for i in idx[n_val:]]

    train_tf, val_tf = get_transforms(args.size)
    train_ds = PolypDataset(train_imgs, args.data_root, train_tf)
    val_ds = PolypDataset(val_imgs, args.data_root, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # val: disjoint strided shard per rank, metrics summed over ranks
    val_ds.images = val_ds.images[rank::world_size]
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=8, shuffle=False, num_workers=4)

    model = smp.Unet(encoder_name=args.encoder, encoder_weights="imagenet", in_channels=3, classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    dice_loss = smp.losses.DiceLoss(mode="binary", from_logits=True)
    bce = nn.BCEWithLogitsLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=20, eta_min=1e-6)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pth")
    best_path = os.path.join(args.ckpt_dir, "best.pth")

    start_epoch, best_dice = 0, 0.0
    if args.resume and os.path.exists(last_path):
        state = torch.load(last_path, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best_dice = state["epoch"] + 1, state["best_dice"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, best dice {best_dice:.4f}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for img, mask in tqdm(train_loader, disable=rank != 0, desc=f"ep {epoch}", leave=False):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = dice_loss(logits, mask) + bce(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        model.eval()
        sums = torch.zeros(3, device=device)  # dice, iou, n images
        with torch.no_grad():
            for img, mask in val_loader:
                img, mask = img.to(device), mask.to(device)
                d, j = dice_iou_sums(model.module(img), mask)
                sums += torch.stack([d, j, torch.tensor(float(img.size(0)), device=device)])
        dist.all_reduce(run)
        dist.all_reduce(sums)
        val_dice, val_iou = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()

        is_best = val_dice > best_dice
        best_dice = max(best_dice, val_dice)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {(run[0] / run[1]).item():.4f} | val dice {val_dice:.4f} "
                  f"iou {val_iou:.4f} | best {best_dice:.4f} | {time.time() - t0:.0f}s")

        checkpoint = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best_dice": best_dice,
        }
        torch.save(checkpoint, last_path)
        if is_best:
            torch.save(checkpoint, best_path)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
