"""Land-use segmentation on Gaofen-2 scenes (GID-15 style), split by scene.

Each scene (~7200 x 6800 px, 4 bands) is cut on the fly into 512 px windows.
Validation scenes are held out entirely so that neighbouring windows of the
same scene never end up on both sides of the split.

    torchrun --nproc_per_node=8 16_scene_split_landuse.py \
        --scene-dir /data/gid15/image_NirRGB --label-dir /data/gid15/label_15classes_idx
"""
import argparse
import glob
import logging
import os
import random

import numpy as np
import rasterio
from rasterio.windows import Window
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

NUM_CLASSES = 15
IGNORE = 255       # 0 in the source labels = unlabelled, shifted to 255

GF2_MEAN = np.array([431.0, 355.2, 326.4, 442.7], np.float32)[:, None, None]
GF2_STD = np.array([131.4, 118.9, 109.0, 155.3], np.float32)[:, None, None]

log = logging.getLogger("gid15")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene-dir", required=True)
    ap.add_argument("--label-dir", required=True)
    ap.add_argument("--out-dir", default="/data/gid15/runs/pspnet")
    ap.add_argument("--n-val-scenes", type=int, default=15)
    ap.add_argument("--win", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=2023)
    return ap.parse_args()


def scene_windows(scene_paths, win):
    windows = []
    for s, path in enumerate(scene_paths):
        with rasterio.open(path) as src:
            h, w = src.height, src.width
        for y in range(0, h - win + 1, win):
            for x in range(0, w - win + 1, win):
                windows.append((s, y, x))
    return windows


class GIDWindows(Dataset):
    def __init__(self, scenes, label_dir, win, augment):
        self.scenes, self.label_dir, self.win, self.augment = scenes, label_dir, win, augment
        self.windows = scene_windows(scenes, win)

    def __len__(self):
        return len(self.windows)

    def label_path(self, scene):
        return os.path.join(self.label_dir, os.path.basename(scene).replace(".tif", "_label.tif"))

    def __getitem__(self, i):
        s, y, x = self.windows[i]
        win = Window(x, y, self.win, self.win)
        with rasterio.open(self.scenes[s]) as src:
            img = src.read(window=win).astype(np.float32)
        with rasterio.open(self.label_path(self.scenes[s])) as src:
            lbl = src.read(1, window=win).astype(np.int64)
        lbl = np.where(lbl == 0, IGNORE, lbl - 1)
        img = (img - GF2_MEAN) / GF2_STD
        if self.augment:
            if random.random() < 0.5:
                img, lbl = img[:, :, ::-1], lbl[:, ::-1]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[::-1]
            if random.random() < 0.5:
                img, lbl = img.transpose(0, 2, 1), lbl.T
        return torch.from_numpy(img.copy()), torch.from_numpy(lbl.copy())


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    # augmentation streams should differ between ranks
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    scenes = sorted(glob.glob(os.path.join(args.scene_dir, "*.tif")))
    random.shuffle(scenes)
    val_scenes, train_scenes = scenes[:args.n_val_scenes], scenes[args.n_val_scenes:]
    log.info("%d scenes: %d train / %d val", len(scenes), len(train_scenes), len(val_scenes))

    train_ds = GIDWindows(train_scenes, args.label_dir, args.win, augment=True)
    val_ds = GIDWindows(val_scenes, args.label_dir, args.win, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.batch_size, num_workers=8, pin_memory=True)

    model = smp.PSPNet("resnet101", encoder_weights=None, in_channels=4, classes=NUM_CLASSES,
                       encoder_depth=5, upsampling=8)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    base_lr = args.lr * args.batch_size * world / 16
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)
    max_it = args.epochs * len(train_dl)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "val_scenes.txt"), "w") as f:
            f.write("\n".join(val_scenes))

    it, best = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lr = poly_lr(optimizer, base_lr, it, max_it)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if it % 100 == 0:
                log.info("epoch %d it %d lr %.5f loss %.4f", epoch, it, lr, loss.item())

        model.eval()
        cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                p = model.module(x).argmax(1)
                m = y != IGNORE
                cm += torch.bincount(y[m] * NUM_CLASSES + p[m],
                                     minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
        dist.all_reduce(cm)
        cm = cm.double()
        iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
        fwiou = ((cm.sum(1) / cm.sum()) * iou).sum().item()
        miou = iou.mean().item()
        log.info("epoch %d: mIoU %.4f FWIoU %.4f OA %.4f", epoch, miou, fwiou,
                 (cm.diag().sum() / cm.sum()).item())
        if rank == 0:
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "iou": iou.tolist()}
            torch.save(state, os.path.join(args.out_dir, "last.pth"))
            if miou > best:
                best = miou
                torch.save(state, os.path.join(args.out_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
