"""Building footprint segmentation, SpaceNet-7 style 4 m PlanetScope mosaics + 0.3 m WV3 pan-sharpened.

Each training sample is a 768x768 crop of a 1024x1024 chip; the target has three
channels (footprint, boundary, contact) as in the SpaceNet winning solutions.

    torchrun --nnodes=1 --nproc_per_node=8 17_spacenet_building_unet.py \
        --chips /mnt/data/spacenet/chips --fold 0
"""
import argparse
import glob
import json
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--chips", required=True)
    p.add_argument("--folds-json", default="folds.json")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--encoder", default="efficientnet-b5")
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=2, help="per GPU; 768px crops with b5 fill a 24GB card")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--save-dir", default="/mnt/data/spacenet/weights")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ChipDataset(Dataset):
    def __init__(self, chip_ids, root, crop=None, train=True):
        self.ids = chip_ids
        self.root = root
        self.train = train
        if train:
            self.aug = A.Compose([
                A.RandomCrop(crop, crop),
                A.HorizontalFlip(), A.VerticalFlip(), A.RandomRotate90(),
                A.ShiftScaleRotate(shift_limit=0.05, scale_limit=0.2, rotate_limit=15, border_mode=cv2.BORDER_REFLECT, p=0.5),
                A.RandomBrightnessContrast(0.15, 0.15, p=0.5),
            ])
        else:
            self.aug = None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        cid = self.ids[i]
        img = cv2.imread(os.path.join(self.root, "images", f"{cid}.png"), cv2.IMREAD_COLOR)[:, :, ::-1]
        msk = cv2.imread(os.path.join(self.root, "masks3c", f"{cid}.png"), cv2.IMREAD_COLOR)
        if self.aug is not None:
            out = self.aug(image=img, mask=msk)
            img, msk = out["image"], out["mask"]
        img = (img.astype(np.float32) / 255.0 - 0.5) / 0.25
        msk = (msk > 127).astype(np.float32)
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(msk.transpose(2, 0, 1).copy())


class DiceBCE(nn.Module):
    def __init__(self, weights=(1.0, 0.2, 0.5)):
        super().__init__()
        self.bce = nn.BCEWithLogitsLoss(reduction="none")
        self.register_buffer("w", torch.tensor(weights).view(1, -1, 1, 1))

    def forward(self, logits, target):
        bce = (self.bce(logits, target) * self.w).mean()
        prob = logits.sigmoid()
        inter = (prob * target).sum((2, 3))
        dice = 1 - (2 * inter + 1) / (prob.sum((2, 3)) + target.sum((2, 3)) + 1)
        return bce + (dice * self.w.view(1, -1)).mean()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    with open(args.folds_json) as f:
        folds = json.load(f)
    val_ids = folds[str(args.fold)]
    all_ids = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(args.chips, "images", "*.png")))
    train_ids = [c for c in all_ids if c not in set(val_ids)]

    train_ds = ChipDataset(train_ids, args.chips, args.crop, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_ds = ChipDataset(sorted(val_ids)[rank::world], args.chips, train=False)
    val_dl = DataLoader(val_ds, batch_size=2, shuffle=False, num_workers=2, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights="imagenet", classes=3, decoder_attention_type="scse")
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    criterion = DiceBCE().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 60, 70], gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_f = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for step, (img, msk) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            msk = msk.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(img), msk)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} it {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)
        scheduler.step()
        dist.all_reduce(loss_acc)

        # pixel F1 on the footprint channel over the whole held-out fold
        model.eval()
        stats = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, msk in val_dl:
                img, msk = img.to(device), msk.to(device)
                with torch.cuda.amp.autocast():
                    pred = model.module(img)[:, 0].float().sigmoid() > 0.5
                gt = msk[:, 0] > 0.5
                stats += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum()]).double()
        dist.all_reduce(stats)
        tp, fp, fn = stats.tolist()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)

        if rank == 0:
            print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} val F1 {f1:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "f1": f1},
                       os.path.join(args.save_dir, f"unet_{args.encoder}_fold{args.fold}_last.pth"))
            if f1 > best_f:
                best_f = f1
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "f1": f1},
                           os.path.join(args.save_dir, f"unet_{args.encoder}_fold{args.fold}_best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
