"""PSPNet-ResNet50 on PASCAL VOC 2012 aug (10582 train / 1449 val).

    torchrun --standalone --nproc_per_node=4 10_pspnet_voc.py --data-root /data/VOCdevkit/VOC2012 --epochs 50
"""
import argparse
import logging
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from seg.datasets import VOCAugSegmentation
from seg.models import PSPNet
from seg import transforms as ST


@dataclass
class Config:
    data_root: str = "/data/VOCdevkit/VOC2012"
    num_classes: int = 21
    ignore_label: int = 255
    crop_size: int = 473
    base_size: int = 512
    batch_size: int = 4  # per gpu
    epochs: int = 50
    base_lr: float = 0.01
    aux_weight: float = 0.4
    power: float = 0.9
    weight_decay: float = 1e-4
    workers: int = 4
    save_dir: str = "exp/pspnet50_voc"
    mean: tuple = (0.485, 0.456, 0.406)
    std: tuple = (0.229, 0.224, 0.225)
    scales: list = field(default_factory=lambda: [0.5, 2.0])


def parse_config():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in vars(cfg).items():
        if isinstance(v, (int, float, str)):
            ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    ns = ap.parse_args()
    for k, v in vars(ns).items():
        setattr(cfg, k, v)
    return cfg


def get_logger(rank):
    logger = logging.getLogger("pspnet")
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
    logger.addHandler(h)
    return logger


def fast_hist(label, pred, n):
    k = (label >= 0) & (label < n)
    return np.bincount(n * label[k].astype(int) + pred[k], minlength=n ** 2).reshape(n, n)


@torch.no_grad()
def validate(model, loader, cfg, device):
    model.eval()
    hist = np.zeros((cfg.num_classes, cfg.num_classes), dtype=np.int64)
    for image, target in loader:
        image = image.to(device, non_blocking=True)
        logits = model(image)
        if isinstance(logits, tuple):
            logits = logits[0]
        logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=True)
        pred = logits.argmax(1).cpu().numpy()
        for lt, lp in zip(target.numpy(), pred):
            hist += fast_hist(lt.flatten(), lp.flatten(), cfg.num_classes)
    hist = torch.from_numpy(hist)
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    hist = hist.numpy()
    iou = np.diag(hist) / np.maximum(hist.sum(1) + hist.sum(0) - np.diag(hist), 1)
    model.train()
    return float(np.nanmean(iou)), iou


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logger = get_logger(rank)

    if rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        wandb.init(project="pspnet-voc", config=vars(cfg), dir=cfg.save_dir)

    train_tf = ST.Compose([
        ST.RandScale(cfg.scales),
        ST.RandRotate([-10, 10], padding=[int(m * 255) for m in cfg.mean], ignore_label=cfg.ignore_label),
        ST.RandomGaussianBlur(),
        ST.RandomHorizontalFlip(),
        ST.Crop([cfg.crop_size, cfg.crop_size], crop_type="rand", padding=[int(m * 255) for m in cfg.mean],
                ignore_label=cfg.ignore_label),
        ST.ToTensor(),
        ST.Normalize(mean=cfg.mean, std=cfg.std),
    ])
    val_tf = ST.Compose([ST.ToTensor(), ST.Normalize(mean=cfg.mean, std=cfg.std)])
    train_set = VOCAugSegmentation(cfg.data_root, split="train_aug", transform=train_tf)
    val_set = VOCAugSegmentation(cfg.data_root, split="val", transform=val_tf)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    # strided shard of the val set, no padding (1449 images do not split evenly)
    val_shard = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=cfg.workers, pin_memory=True)

    model = PSPNet(layers=50, classes=cfg.num_classes, zoom_factor=8, pretrained=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # lr x10 for the PPM and classifier, which are trained from scratch
    modules_ori = [model.layer0, model.layer1, model.layer2, model.layer3, model.layer4]
    modules_new = [model.ppm, model.cls, model.aux]
    params = [{"params": m.parameters(), "lr": cfg.base_lr} for m in modules_ori]
    params += [{"params": m.parameters(), "lr": cfg.base_lr * 10} for m in modules_new]
    optimizer = torch.optim.SGD(params, lr=cfg.base_lr, momentum=0.9, weight_decay=cfg.weight_decay)
    index_split = len(modules_ori)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    criterion = nn.CrossEntropyLoss(ignore_index=cfg.ignore_label)

    max_iter = cfg.epochs * len(train_loader)
    best_miou = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(1, device=device)
        t0 = time.time()
        for i, (image, target) in enumerate(train_loader):
            cur_iter = epoch * len(train_loader) + i
            lr = cfg.base_lr * (1 - cur_iter / max_iter) ** cfg.power
            for idx, g in enumerate(optimizer.param_groups):
                g["lr"] = lr if idx < index_split else lr * 10

            image = image.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True).long()
            main_out, aux_out = model(image)
            main_loss = criterion(main_out, target)
            aux_loss = criterion(aux_out, target)
            loss = main_loss + cfg.aux_weight * aux_loss

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += main_loss.detach()

            if rank == 0 and (i + 1) % 20 == 0:
                logger.info(f"Epoch {epoch + 1}/{cfg.epochs} [{i + 1}/{len(train_loader)}] "
                            f"main {main_loss.item():.4f} aux {aux_loss.item():.4f} lr {lr:.5f}")
                wandb.log({"train/main_loss": main_loss.item(), "train/aux_loss": aux_loss.item(), "lr": lr},
                          step=cur_iter)

        dist.all_reduce(loss_sum)
        epoch_loss = loss_sum.item() / (len(train_loader) * world_size)

        miou, per_class = validate(model.module, val_loader, cfg, device)
        logger.info(f"Epoch {epoch + 1}: train loss {epoch_loss:.4f} val mIoU {miou:.4f} "
                    f"({time.time() - t0:.0f}s)")
        if rank == 0:
            wandb.log({"val/mIoU": miou, "train/epoch_loss": epoch_loss, "epoch": epoch + 1})
            state = {"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "miou": miou}
            torch.save(state, os.path.join(cfg.save_dir, "train_epoch_last.pth"))
            if miou > best_miou:
                best_miou = miou
                torch.save(state, os.path.join(cfg.save_dir, "best.pth"))
                logger.info(f"new best mIoU {best_miou:.4f}")

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
