"""Semantic segmentation (UNet, ResNet-34 encoder) on Cityscapes-style data.
DDP + SyncBatchNorm + fp16 autocast / GradScaler.

torchrun --nproc_per_node=4 06_ddp_unet_seg.py --root /data/cityscapes --epochs 200
"""
import argparse
import os
import random
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 19
IGNORE_INDEX = 255
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class SegFolder(Dataset):
    def __init__(self, root, split, crop=768, train=True):
        self.img_dir = os.path.join(root, "leftImg8bit", split)
        self.lbl_dir = os.path.join(root, "gtFine", split)
        self.items = []
        for city in sorted(os.listdir(self.img_dir)):
            for f in sorted(os.listdir(os.path.join(self.img_dir, city))):
                stem = f.replace("_leftImg8bit.png", "")
                self.items.append((os.path.join(self.img_dir, city, f),
                                   os.path.join(self.lbl_dir, city, stem + "_gtFine_labelTrainIds.png")))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = np.asarray(Image.open(self.items[i][0]).convert("RGB"), dtype=np.float32) / 255.0
        lbl = np.asarray(Image.open(self.items[i][1]), dtype=np.int64)
        if self.train:
            h, w = lbl.shape
            y0, x0 = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            img = img[y0:y0 + self.crop, x0:x0 + self.crop]
            lbl = lbl[y0:y0 + self.crop, x0:x0 + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = (img - MEAN) / STD
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4, help="images per GPU")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0 and share it")
    ap.add_argument("--save", default="work_dirs/unet_r34")
    return ap.parse_args()


def confusion(pred, target, n):
    k = target != IGNORE_INDEX
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).view(n, n)


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    seed = torch.tensor([args.seed if args.seed >= 0 else random.randint(0, 2**31 - 1)], device="cuda")
    dist.broadcast(seed, src=0)
    seed = int(seed.item()) + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = SegFolder(args.root, "train", args.crop, train=True)
    val_ds = SegFolder(args.root, "val", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    train_loader = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=4, pin_memory=True)

    model = smp.Unet("resnet34", encoder_weights="imagenet", classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    max_iter = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / max_iter) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    best_miou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, lbl) in enumerate(train_loader):
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = criterion(logits, lbl)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] loss={loss.item():.4f} "
                      f"lr={sched.get_last_lr()[0]:.5f} scale={scaler.get_scale():.0f} "
                      f"{time.time() - t0:.1f}s", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            model.eval()
            conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
            with torch.no_grad():
                for img, lbl in val_loader:
                    img, lbl = img.to(device), lbl.to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        logits = model.module(img)
                    conf += confusion(logits.argmax(1).flatten(), lbl.flatten(), NUM_CLASSES)
            dist.all_reduce(conf)
            iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
            miou = iou.mean().item()
            if rank == 0:
                print(f"epoch {epoch}: mIoU {miou * 100:.2f}", flush=True)
                os.makedirs(args.save, exist_ok=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                           os.path.join(args.save, "latest.pth"))
                if miou > best_miou:
                    best_miou = miou
                    torch.save(model.module.state_dict(), os.path.join(args.save, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
