#!/usr/bin/env python
# Semantic segmentation on Cityscapes with a U-Net (ResNet-34 encoder).
#
#   sbatch -N 2 --ntasks-per-node=4 --gres=gpu:4 -c 8 -t 10:00:00 seg.sbatch
#
# seg.sbatch:
#   export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
#   export MASTER_PORT=29411
#   srun python train_unet_cityscapes.py --root /lustre/datasets/cityscapes \
#        --work-dir /lustre/home/$USER/seg/unet_r34
import os

# pin each task to its own GPU before torch initialises CUDA
os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("SLURM_LOCALID", "0")

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import segmentation_models_pytorch as smp
import albumentations as A
from albumentations.pytorch import ToTensorV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes

IGNORE = 255
NUM_CLASSES = 19


class CityscapesSeg(Dataset):
    def __init__(self, root, split, transform):
        self.base = Cityscapes(root, split=split, mode="fine", target_type="semantic")
        self.transform = transform
        # 34 raw ids -> 19 train ids
        lut = np.full(256, IGNORE, dtype=np.uint8)
        for c in Cityscapes.classes:
            if not c.ignore_in_eval:
                lut[c.id] = c.train_id
        self.lut = lut

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, target = self.base[i]
        img = np.asarray(img)
        mask = self.lut[np.asarray(target)]
        out = self.transform(image=img, mask=mask)
        return out["image"], out["mask"].long()


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--eval-every", type=int, default=10)
    return p.parse_args()


def confusion(pred, target, n):
    k = target != IGNORE
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).reshape(n, n)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        logits = model(img)
        hist += confusion(logits.argmax(1).flatten(), mask.flatten(), NUM_CLASSES)
    dist.all_reduce(hist)
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    return iou.mean().item()


def main():
    args = get_args()
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda")
    dist.init_process_group("nccl", rank=rank, world_size=world_size)

    train_tf = A.Compose([
        A.RandomScale(scale_limit=(-0.5, 1.0)),
        A.PadIfNeeded(args.crop, args.crop, border_mode=0, mask_value=IGNORE),
        A.RandomCrop(args.crop, args.crop),
        A.HorizontalFlip(),
        A.ColorJitter(0.2, 0.2, 0.2, 0.0, p=0.5),
        A.Normalize(),
        ToTensorV2(),
    ])
    val_tf = A.Compose([A.Normalize(), ToTensorV2()])
    train_ds = CityscapesSeg(args.root, "train", train_tf)
    val_ds = CityscapesSeg(args.root, "val", val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    nw = int(os.environ.get("SLURM_CPUS_PER_TASK", 8))
    train_loader = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler,
                              num_workers=nw, pin_memory=True, drop_last=True)
    val_part = Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_part, batch_size=1, num_workers=nw)

    model = smp.Unet("resnet34", encoder_weights="imagenet", classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    max_iter = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=max_iter, power=0.9)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    ckpt_path = os.path.join(args.work_dir, "latest.pth")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        running = torch.zeros(1, device=device)
        for img, mask in train_loader:
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            logits = model(img)
            loss = criterion(logits, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.detach()
        dist.all_reduce(running)
        mean_loss = running.item() / (world_size * len(train_loader))
        if rank == 0:
            print(f"[{epoch}] loss {mean_loss:.4f} ({time.time() - tic:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            miou = evaluate(model.module, val_loader, device)
            if rank == 0:
                print(f"[{epoch}] mIoU {miou * 100:.2f}", flush=True)
                if miou > best:
                    best = miou
                    torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))

        if rank == 0:
            torch.save({"model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
