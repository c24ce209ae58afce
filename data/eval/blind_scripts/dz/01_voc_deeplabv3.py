#!/usr/bin/env python
"""DeepLabV3 (ResNet-101, OS=8) on PASCAL VOC 2012 + SBD aug.

Iteration-based schedule as in the paper: 30k iters, poly(0.9), batch 16
(8 GPUs x 2), 513x513 crops with random scale [0.5, 2.0].
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet101_Weights
from torchvision.models.segmentation import deeplabv3_resnet101

IGNORE_INDEX = 255
NUM_CLASSES = 21
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]

logger = logging.getLogger("voc")


def parse_args():
    p = argparse.ArgumentParser(description="DeepLabV3 VOC trainer")
    p.add_argument("--data-root", default="/datasets/VOCdevkit/VOC2012")
    p.add_argument("--train-list", default="ImageSets/Segmentation/train_aug.txt")
    p.add_argument("--val-list", default="ImageSets/Segmentation/val.txt")
    p.add_argument("--work-dir", default="work_dirs/deeplabv3_r101_voc")
    p.add_argument("--crop-size", type=int, default=513)
    p.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    p.add_argument("--iters", type=int, default=30000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=3000)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class VOCSegmentation(Dataset):
    def __init__(self, root, list_file, crop_size=513, train=True):
        self.root = root
        with open(os.path.join(root, list_file)) as f:
            self.ids = [line.strip() for line in f if line.strip()]
        self.crop_size = crop_size
        self.train = train

    def __len__(self):
        return len(self.ids)

    def _train_transform(self, img, mask):
        scale = random.uniform(0.5, 2.0)
        w, h = img.size
        nw, nh = int(w * scale + 0.5), int(h * scale + 0.5)
        img = img.resize((nw, nh), Image.BILINEAR)
        mask = mask.resize((nw, nh), Image.NEAREST)
        pad_h, pad_w = max(self.crop_size - nh, 0), max(self.crop_size - nw, 0)
        if pad_h or pad_w:
            img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
            mask = TF.pad(mask, [0, 0, pad_w, pad_h], fill=IGNORE_INDEX)
        w, h = img.size
        x = random.randint(0, w - self.crop_size)
        y = random.randint(0, h - self.crop_size)
        img = img.crop((x, y, x + self.crop_size, y + self.crop_size))
        mask = mask.crop((x, y, x + self.crop_size, y + self.crop_size))
        if random.random() < 0.5:
            img, mask = TF.hflip(img), TF.hflip(mask)
        return img, mask

    def __getitem__(self, idx):
        name = self.ids[idx]
        img = Image.open(os.path.join(self.root, "JPEGImages", name + ".jpg")).convert("RGB")
        mask = Image.open(os.path.join(self.root, "SegmentationClassAug", name + ".png"))
        if self.train:
            img, mask = self._train_transform(img, mask)
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        mask = torch.from_numpy(np.array(mask, dtype=np.int64))
        return img, mask


def poly_lr(base_lr, it, max_iters, power=0.9):
    return base_lr * (1 - it / max_iters) ** power


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.float64, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        logits = model(img)["out"]
        pred = logits.argmax(1)
        valid = mask != IGNORE_INDEX
        idx = mask[valid] * NUM_CLASSES + pred[valid]
        hist += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES).double()
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    acc = hist.diag().sum() / hist.sum().clamp(min=1)
    model.train()
    return iou.mean().item(), acc.item(), iou.cpu().numpy()


def save_checkpoint(path, model, optimizer, it, best_miou):
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iter": it,
        "best_miou": best_miou,
    }, path)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        logger.info("world size %d, per-GPU batch %d", world_size, args.batch_size)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = VOCSegmentation(args.data_root, args.train_list, args.crop_size, train=True)
    val_set = VOCSegmentation(args.data_root, args.val_list, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # strided shard without padding so every val image is counted exactly once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # VOC val images have different sizes, evaluate one image at a time
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False,
                            num_workers=2, pin_memory=True)

    model = deeplabv3_resnet101(weights=None, weights_backbone=ResNet101_Weights.IMAGENET1K_V2,
                                num_classes=NUM_CLASSES, aux_loss=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    backbone_params = list(model.module.backbone.parameters())
    head_params = list(model.module.classifier.parameters())
    optimizer = torch.optim.SGD(
        [{"params": backbone_params, "lr": args.lr},
         {"params": head_params, "lr": args.lr * 10}],
        lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    best_miou = 0.0
    it, epoch = 0, 0
    tic = time.time()
    model.train()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for img, mask in train_loader:
            if it >= args.iters:
                break
            lr = poly_lr(args.lr, it, args.iters)
            optimizer.param_groups[0]["lr"] = lr
            optimizer.param_groups[1]["lr"] = lr * 10

            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            out = model(img)["out"]
            loss = criterion(out, mask)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

            if it % args.log_interval == 0:
                loss_val = loss.detach().clone()
                dist.all_reduce(loss_val)
                loss_val /= world_size
                if rank == 0:
                    logger.info("iter %d/%d lr %.5f loss %.4f (%.2fs/it)", it, args.iters, lr,
                                loss_val.item(), (time.time() - tic) / args.log_interval)
                tic = time.time()

            if it % args.eval_interval == 0 or it == args.iters:
                miou, acc, _ = evaluate(model.module, val_loader, device)
                if rank == 0:
                    logger.info("iter %d: mIoU %.2f pixAcc %.2f", it, miou * 100, acc * 100)
                    save_checkpoint(os.path.join(args.work_dir, "latest.pth"), model, optimizer, it, best_miou)
                    if miou > best_miou:
                        best_miou = miou
                        save_checkpoint(os.path.join(args.work_dir, "best.pth"), model, optimizer, it, best_miou)
                dist.barrier()
        epoch += 1

    if rank == 0:
        logger.info("done, best mIoU %.2f", best_miou * 100)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
