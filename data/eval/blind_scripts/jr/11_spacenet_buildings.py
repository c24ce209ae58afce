"""
Building footprint segmentation, SpaceNet-2 (WorldView-3 8-band multispectral, pan-sharpened 0.3 m).
Targets are rasterised footprints (+ a 2 px contact/border class to split touching buildings).

    torchrun --nproc_per_node=8 11_spacenet_buildings.py --data /data/spacenet2 --aoi Vegas Paris Shanghai Khartoum
"""
import argparse
import os
import time

import albumentations as A
import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser(description="SpaceNet-2 building segmentation")
    parser.add_argument("--data", required=True)
    parser.add_argument("--aoi", nargs="+", default=["Vegas", "Paris", "Shanghai", "Khartoum"])
    parser.add_argument("--encoder", default="efficientnet-b4")
    parser.add_argument("--crop", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save_dir", default="./weights/sn2_effb4")
    parser.add_argument("--fold", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class SpaceNetMS(Dataset):
    def __init__(self, root, df, transform, stats):
        self.root = root
        self.df = df.reset_index(drop=True)
        self.transform = transform
        self.p1, self.p99 = stats

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        img = tifffile.imread(os.path.join(self.root, row.aoi_dir, "MUL-PanSharpen", row.image)).astype(np.float32)
        mask = np.load(os.path.join(self.root, "masks", row.image.replace(".tif", ".npy")))  # H, W, 2 (body, contact)
        img = np.clip((img - self.p1) / (self.p99 - self.p1), 0.0, 1.0)
        out = self.transform(image=img, mask=mask)
        img = torch.from_numpy(out["image"].transpose(2, 0, 1).copy())
        mask = torch.from_numpy(out["mask"].transpose(2, 0, 1).astype(np.float32).copy())
        return img, mask


def build_transforms(crop):
    train_tf = A.Compose([
        A.RandomCrop(crop, crop),
        A.HorizontalFlip(),
        A.VerticalFlip(),
        A.RandomRotate90(),
        A.ShiftScaleRotate(shift_limit=0.05, scale_limit=0.1, rotate_limit=10, border_mode=0, p=0.3),
    ])
    val_tf = A.Compose([A.PadIfNeeded(672, 672, border_mode=0), A.CenterCrop(640, 640)])
    return train_tf, val_tf


class ComboLoss(nn.Module):
    def __init__(self, w_contact=0.5):
        super().__init__()
        self.dice = smp.losses.DiceLoss("multilabel", from_logits=True)
        self.focal = smp.losses.FocalLoss("multilabel")
        self.w_contact = w_contact

    def forward(self, logits, target):
        body = self.dice(logits[:, :1], target[:, :1]) + 10.0 * self.focal(logits[:, :1], target[:, :1])
        contact = self.dice(logits[:, 1:], target[:, 1:]) + 10.0 * self.focal(logits[:, 1:], target[:, 1:])
        return body + self.w_contact * contact


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    inter = torch.zeros(1, device=device)
    union = torch.zeros(1, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        prob = torch.sigmoid(model(img))
        building = (prob[:, 0] > 0.5) & (prob[:, 1] < 0.5)
        gt = mask[:, 0] > 0.5
        inter += (building & gt).sum()
        union += (building | gt).sum()
    dist.all_reduce(inter)
    dist.all_reduce(union)
    return (inter / union.clamp(min=1)).item()


def main():
    args = get_parser().parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True

    folds = pd.read_csv(os.path.join(args.data, "folds.csv"))  # image, aoi_dir, fold
    folds = folds[folds.aoi_dir.str.contains("|".join(args.aoi))]
    stats = np.load(os.path.join(args.data, "ms_percentiles.npy"))  # (2, 8)
    train_tf, val_tf = build_transforms(args.crop)
    train_ds = SpaceNetMS(args.data, folds[folds.fold != args.fold], train_tf, (stats[0], stats[1]))
    # every rank scores its own slice of the held-out fold (no padding / duplicates)
    val_df = folds[folds.fold == args.fold].sort_values("image").iloc[rank::world_size]
    val_ds = SpaceNetMS(args.data, val_df, val_tf, (stats[0], stats[1]))

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=8, classes=2, decoder_attention_type="scse")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    criterion = ComboLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 60, 70], gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"train {len(train_ds)} tiles, val {len(val_ds)} tiles on rank 0, world size {world_size}")

    best_iou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        epoch_loss = torch.zeros(1, device=device)
        for i, (img, mask) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                logits = model(img)
                loss = criterion(logits.float(), mask)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += loss.detach()
        scheduler.step()
        epoch_loss = reduce_mean(epoch_loss / len(train_loader)).item()

        iou = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} loss {epoch_loss:.4f} val IoU {iou:.4f} time {time.time() - start:.0f}s",
                  flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "iou": iou},
                       os.path.join(args.save_dir, f"fold{args.fold}_last.pth"))
            if iou > best_iou:
                best_iou = iou
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "iou": iou},
                           os.path.join(args.save_dir, f"fold{args.fold}_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
