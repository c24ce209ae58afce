"""Land-cover segmentation of Sentinel-2 tiles (10 classes) with a U-Net / ResNet-34 encoder.

    torchrun --nproc_per_node=4 18_satellite_segmentation.py --config configs/landcover_unet.yaml
"""
import argparse
import glob
import logging
import os
from dataclasses import dataclass, field
from typing import List

import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("landcover")
CLASSES = ["water", "trees", "grass", "flooded_veg", "crops", "scrub", "built", "bare", "snow", "clouds"]


@dataclass
class SegConfig:
    tiles_dir: str = "/data/s2/tiles"
    bands: List[int] = field(default_factory=lambda: [2, 3, 4, 8, 11, 12])
    tile: int = 256
    batch_size: int = 16
    epochs: int = 80
    lr: float = 3e-4
    ignore_index: int = 255
    out_dir: str = "/ckpt/landcover"


class TileDataset(Dataset):
    MEAN = np.array([1370, 1184, 1120, 2427, 2006, 1374], dtype=np.float32)[:, None, None]
    STD = np.array([633, 650, 712, 929, 1010, 889], dtype=np.float32)[:, None, None]

    def __init__(self, root, split, bands, train):
        self.images = sorted(glob.glob(os.path.join(root, split, "img", "*.tif")))
        self.bands, self.train = bands, train

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        with rasterio.open(self.images[i]) as src:
            img = src.read(self.bands).astype(np.float32)
        with rasterio.open(self.images[i].replace("/img/", "/mask/")) as src:
            mask = src.read(1).astype(np.int64)
        img = (img - self.MEAN) / self.STD
        if self.train:
            k = np.random.randint(4)
            img, mask = np.rot90(img, k, axes=(1, 2)), np.rot90(mask, k)
            if np.random.rand() < 0.5:
                img, mask = img[:, :, ::-1], mask[:, ::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())


class ConfusionMeter:
    def __init__(self, num_classes, ignore_index=255, device="cuda:0"):
        self.n, self.ignore = num_classes, ignore_index
        self.hist = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)

    def update(self, pred, target):
        valid = target != self.ignore
        idx = target[valid] * self.n + pred[valid]
        self.hist += torch.bincount(idx, minlength=self.n ** 2).view(self.n, self.n)

    def reduce(self):
        dist.all_reduce(self.hist)

    def miou(self):
        h = self.hist.double()
        iou = h.diag() / (h.sum(0) + h.sum(1) - h.diag()).clamp(min=1)
        return iou.mean().item(), iou.cpu().tolist()


def dice_loss(logits, target, ignore_index):
    valid = (target != ignore_index).unsqueeze(1)
    probs = logits.softmax(1) * valid
    onehot = F.one_hot(target.clamp(max=logits.size(1) - 1), logits.size(1)).permute(0, 3, 1, 2) * valid
    inter = (probs * onehot).sum((0, 2, 3))
    union = probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    return 1 - ((2 * inter + 1) / (union + 1)).mean()


@torch.no_grad()
def validate(model, loader, device, cfg):
    model.eval()
    meter = ConfusionMeter(len(CLASSES), cfg.ignore_index)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        meter.update(model(img).argmax(1), mask)
    meter.reduce()
    model.train()
    return meter.miou()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = SegConfig(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    train_ds = TileDataset(cfg.tiles_dir, "train", cfg.bands, train=True)
    val_ds = TileDataset(cfg.tiles_dir, "val", cfg.bands, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, pin_memory=True)

    model = smp.Unet("resnet34", encoder_weights=None, in_channels=len(cfg.bands), classes=len(CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    ce = nn.CrossEntropyLoss(ignore_index=cfg.ignore_index)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=cfg.epochs * len(train_loader), power=0.9)

    best = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for img, mask in train_loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            logits = model(img)
            loss = ce(logits, mask) + 0.5 * dice_loss(logits, mask, cfg.ignore_index)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        miou, per_class = validate(model, val_loader, device, cfg)
        if rank == 0:
            logger.info("epoch %d loss %.4f mIoU %.4f | %s", epoch, (running[0] / running[1]).item(), miou,
                        " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, per_class)))
            os.makedirs(cfg.out_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou},
                       os.path.join(cfg.out_dir, "last.pt"))
            if miou > best:
                best = miou
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou},
                           os.path.join(cfg.out_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
