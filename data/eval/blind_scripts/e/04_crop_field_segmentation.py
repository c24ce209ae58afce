#!/usr/bin/env python
"""Field boundary / crop type segmentation on 256x256 Sentinel-2 RGB+NIR tiles.

DeepLabV3-ResNet50, 4 input bands, 7 classes (0 = background).

    torchrun --nproc_per_node=8 04_crop_field_segmentation.py --config configs/deeplab_s2.yaml
    torchrun --nproc_per_node=8 04_crop_field_segmentation.py --config configs/deeplab_s2.yaml \
        --resume runs/deeplab_s2/last.pt
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50
from tqdm import tqdm

DEFAULTS = {
    "data_root": "/data/s2_fields",
    "num_classes": 7,
    "in_channels": 4,
    "epochs": 80,
    "global_batch_size": 64,
    "lr": 0.01,
    "weight_decay": 1e-4,
    "workers": 6,
    "out_dir": "runs/deeplab_s2",
    "ignore_index": 255,
}


class FieldTiles(Dataset):
    """Tiles stored as .npz with 'image' (4,256,256) uint16 and 'mask' (256,256) uint8."""

    def __init__(self, root, split, augment=False):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.names = [l.strip() for l in f if l.strip()]
        self.root = root
        self.augment = augment

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, "tiles", self.names[i] + ".npz"))
        img = d["image"].astype(np.float32) / 10000.0
        mask = d["mask"].astype(np.int64)
        if self.augment:
            if np.random.rand() < 0.5:
                img, mask = img[:, :, ::-1], mask[:, ::-1]
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1, :], mask[::-1, :]
            k = np.random.randint(4)
            img, mask = np.rot90(img, k, axes=(1, 2)), np.rot90(mask, k)
        return torch.from_numpy(img.copy()), torch.from_numpy(mask.copy())


def build_model(cfg):
    model = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=cfg["num_classes"], aux_loss=False)
    model.backbone.conv1 = nn.Conv2d(cfg["in_channels"], 64, 7, 2, 3, bias=False)
    return model


def confusion(pred, target, n, ignore):
    keep = target != ignore
    idx = target[keep] * n + pred[keep]
    return torch.bincount(idx, minlength=n * n).reshape(n, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    assert cfg["global_batch_size"] % world_size == 0
    per_gpu_bs = cfg["global_batch_size"] // world_size

    train_ds = FieldTiles(cfg["data_root"], "train", augment=True)
    val_full = FieldTiles(cfg["data_root"], "val")
    val_ds = Subset(val_full, range(rank, len(val_full), world_size))
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=per_gpu_bs, sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16, shuffle=False, num_workers=cfg["workers"], pin_memory=True)

    model = build_model(cfg)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    params = [
        {"params": model.module.backbone.parameters(), "lr": cfg["lr"]},
        {"params": model.module.classifier.parameters(), "lr": cfg["lr"] * 10},
    ]
    optimizer = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9, weight_decay=cfg["weight_decay"])
    total_iters = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / total_iters) ** 0.9)

    start_epoch, best_miou = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_miou"]
        if is_main:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    if is_main:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"world {world_size}, {per_gpu_bs} tiles/GPU, {len(train_loader)} iters/epoch")

    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for img, mask in tqdm(train_loader, disable=not is_main, leave=False, desc=f"ep{epoch}"):
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            out = model(img)["out"]
            loss = F.cross_entropy(out, mask, ignore_index=cfg["ignore_index"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_meter)

        model.eval()
        conf = torch.zeros(cfg["num_classes"], cfg["num_classes"], dtype=torch.long, device=device)
        with torch.no_grad():
            for img, mask in val_loader:
                img, mask = img.to(device), mask.to(device)
                pred = model.module(img)["out"].argmax(1)
                conf += confusion(pred.flatten(), mask.flatten(), cfg["num_classes"], cfg["ignore_index"])
        dist.all_reduce(conf)
        iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
        miou = iou[1:].mean().item()

        if is_main:
            print(f"epoch {epoch:03d} | loss {(loss_meter[0] / loss_meter[1]).item():.4f} | "
                  f"mIoU {miou:.4f} | {time.time() - t0:.0f}s")
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "best_miou": max(best_miou, miou), "cfg": cfg}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
            if miou > best_miou:
                torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
        best_miou = max(best_miou, miou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
