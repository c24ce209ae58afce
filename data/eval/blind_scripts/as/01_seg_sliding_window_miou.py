"""
Land-cover segmentation on large orthophoto tiles (LoveDA-style).

Training uses random 512x512 crops; validation runs sliding-window inference
over full tiles with overlap and Gaussian-weighted stitching.

    torchrun --nproc_per_node=4 train_seg_sw.py --data-root /data/loveda
"""
import argparse
import os
import glob
import time
import math

import numpy as np
import rasterio
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

NUM_CLASSES = 7
IGNORE_INDEX = 255
CLASS_NAMES = ["background", "building", "road", "water", "barren", "forest", "agriculture"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--encoder", default="resnet50")
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--overlap", type=float, default=0.25)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--out", default="runs/loveda_upernet")
    return p.parse_args()


class TileCropDataset(Dataset):
    def __init__(self, image_paths, crop, train=True):
        self.image_paths = image_paths
        self.crop = crop
        self.train = train

    def __len__(self):
        return len(self.image_paths)

    @staticmethod
    def mask_path(p):
        return p.replace("/images/", "/masks/")

    def __getitem__(self, idx):
        path = self.image_paths[idx]
        with rasterio.open(path) as src:
            img = src.read().astype(np.float32) / 255.0
        with rasterio.open(self.mask_path(path)) as src:
            mask = src.read(1).astype(np.int64)
        # LoveDA: 0 = no-data, classes 1..7
        mask = mask - 1
        mask[mask < 0] = IGNORE_INDEX
        if self.train:
            _, h, w = img.shape
            y = np.random.randint(0, h - self.crop + 1)
            x = np.random.randint(0, w - self.crop + 1)
            img = img[:, y:y + self.crop, x:x + self.crop]
            mask = mask[y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                img = img[:, :, ::-1]
                mask = mask[:, ::-1]
            if np.random.rand() < 0.5:
                img = img[:, ::-1, :]
                mask = mask[::-1, :]
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())


def gaussian_window(size, sigma_scale=0.125):
    coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-(coords ** 2) / (2 * (size * sigma_scale) ** 2))
    w = g[:, None] * g[None, :]
    return w / w.max()


@torch.no_grad()
def sliding_window_predict(model, image, window, overlap, num_classes):
    """image: (1, C, H, W) on device. Returns (num_classes, H, W) probabilities."""
    _, _, H, W = image.shape
    stride = int(window * (1 - overlap))
    pad_h = max(window - H, 0)
    pad_w = max(window - W, 0)
    image = F.pad(image, (0, pad_w, 0, pad_h), mode="reflect")
    _, _, Hp, Wp = image.shape
    weight = gaussian_window(window).to(image.device)
    probs = torch.zeros((num_classes, Hp, Wp), device=image.device)
    norm = torch.zeros((Hp, Wp), device=image.device)
    ys = list(range(0, max(Hp - window, 0) + 1, stride))
    xs = list(range(0, max(Wp - window, 0) + 1, stride))
    if ys[-1] + window < Hp:
        ys.append(Hp - window)
    if xs[-1] + window < Wp:
        xs.append(Wp - window)
    for y in ys:
        for x in xs:
            patch = image[:, :, y:y + window, x:x + window]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(patch)
            p = logits.float().softmax(1)[0]
            probs[:, y:y + window, x:x + window] += p * weight
            norm[y:y + window, x:x + window] += weight
    probs = probs / norm.clamp_min(1e-6)
    return probs[:, :H, :W]


def update_confusion(conf, pred, target, num_classes):
    valid = target != IGNORE_INDEX
    idx = target[valid] * num_classes + pred[valid]
    conf += torch.bincount(idx, minlength=num_classes ** 2).reshape(num_classes, num_classes)
    return conf


def miou_from_confusion(conf):
    conf = conf.double()
    tp = conf.diag()
    denom = conf.sum(0) + conf.sum(1) - tp
    iou = tp / denom.clamp_min(1)
    return iou.mean().item(), iou.cpu().numpy()


def evaluate(model, loader, device, args):
    model.eval()
    conf = torch.zeros((NUM_CLASSES, NUM_CLASSES), dtype=torch.long, device=device)
    for img, mask in loader:
        img = img.to(device, non_blocking=True)
        mask = mask.to(device, non_blocking=True)
        probs = sliding_window_predict(model, img, args.crop, args.overlap, NUM_CLASSES)
        pred = probs.argmax(0)
        conf = update_confusion(conf, pred.flatten(), mask[0].flatten(), NUM_CLASSES)
    model.train()
    return miou_from_confusion(conf)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_imgs = sorted(glob.glob(os.path.join(args.data_root, "Train", "*", "images", "*.png")))
    val_imgs = sorted(glob.glob(os.path.join(args.data_root, "Val", "*", "images", "*.png")))

    train_ds = TileCropDataset(train_imgs, args.crop, train=True)
    val_ds = TileCropDataset(val_imgs, args.crop, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    model = smp.UPerNet(encoder_name=args.encoder, encoder_weights="imagenet",
                        in_channels=3, classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_iters = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: (1 - it / total_iters) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    best_miou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for img, mask in train_loader:
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = criterion(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1

        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {(running[0] / running[1]).item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} time {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            miou, per_class = evaluate(model.module, val_loader, device, args)
            if rank == 0:
                print(f"  val mIoU {miou * 100:.2f}")
                for name, v in zip(CLASS_NAMES, per_class):
                    print(f"    {name:<12s} {v * 100:.2f}")
                if miou > best_miou:
                    best_miou = miou
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou},
                               os.path.join(args.out, "best.pth"))
            dist.barrier()

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "epoch": args.epochs},
                   os.path.join(args.out, "last.pth"))
        print(f"done, best mIoU {best_miou * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
