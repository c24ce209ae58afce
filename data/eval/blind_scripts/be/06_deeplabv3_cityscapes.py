"""DeepLabV3+ (ResNet-101, OS=16) on Cityscapes fine annotations.

torchrun --nproc_per_node=4 06_deeplabv3_cityscapes.py --root /data/cityscapes --epochs 200 --bs 4
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes

import ext_transforms as et
from network import deeplabv3plus_resnet101
from utils.loss import OhemCrossEntropy

NUM_CLASSES = 19
IGNORE = 255


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/cityscapes")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--bs", type=int, default=4, help="batch size per process")
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--warmup-iters", type=int, default=1000)
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--ckpt-dir", default="checkpoints/dlv3p_city")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--no-amp", action="store_true")
    return ap.parse_args()


class CityscapesTrainIds(Cityscapes):
    id_to_train_id = np.array([c.train_id if c.train_id not in (-1, 255) else 255 for c in Cityscapes.classes])

    @classmethod
    def encode(cls, target):
        return torch.from_numpy(cls.id_to_train_id[np.array(target)]).long()


def build_loaders(args, world_size, rank):
    train_tf = et.ExtCompose([
        et.ExtRandomScale((0.5, 2.0)),
        et.ExtRandomCrop(size=(args.crop, args.crop), pad_if_needed=True),
        et.ExtColorJitter(brightness=0.5, contrast=0.5, saturation=0.5),
        et.ExtRandomHorizontalFlip(),
        et.ExtToTensor(),
        et.ExtNormalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        et.ExtEncode(CityscapesTrainIds.encode),
    ])
    val_tf = et.ExtCompose([
        et.ExtToTensor(),
        et.ExtNormalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        et.ExtEncode(CityscapesTrainIds.encode),
    ])
    train_ds = CityscapesTrainIds(args.root, split="train", mode="fine", target_type="semantic", transforms=train_tf)
    val_ds = CityscapesTrainIds(args.root, split="val", mode="fine", target_type="semantic", transforms=val_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2, pin_memory=True)
    return train_loader, val_loader, train_sampler


class StreamSegMetrics:
    def __init__(self, n_classes):
        self.n = n_classes
        self.confusion = np.zeros((n_classes, n_classes), dtype=np.int64)

    def update(self, label_trues, label_preds):
        for lt, lp in zip(label_trues, label_preds):
            mask = (lt >= 0) & (lt < self.n)
            self.confusion += np.bincount(self.n * lt[mask].astype(int) + lp[mask],
                                          minlength=self.n ** 2).reshape(self.n, self.n)

    def get_results(self):
        hist = self.confusion
        acc = np.diag(hist).sum() / hist.sum()
        iu = np.diag(hist) / (hist.sum(axis=1) + hist.sum(axis=0) - np.diag(hist))
        return {"Overall Acc": acc, "Mean IoU": np.nanmean(iu), "Class IoU": dict(enumerate(iu))}


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    metrics = StreamSegMetrics(NUM_CLASSES)
    for images, labels in loader:
        images = images.to(device, dtype=torch.float32, non_blocking=True)
        outputs = model(images)
        outputs = F.interpolate(outputs, size=labels.shape[-2:], mode="bilinear", align_corners=False)
        preds = outputs.argmax(1).cpu().numpy()
        metrics.update(labels.numpy(), preds)
    model.train()
    return metrics.get_results()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0
    if is_main:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    train_loader, val_loader, train_sampler = build_loaders(args, world_size, rank)

    model = deeplabv3plus_resnet101(num_classes=NUM_CLASSES, output_stride=16, pretrained_backbone=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD([
        {"params": model.module.backbone.parameters(), "lr": args.lr * 0.1},
        {"params": model.module.classifier.parameters(), "lr": args.lr},
    ], lr=args.lr, momentum=0.9, weight_decay=args.wd)
    for g in optimizer.param_groups:
        g["init_lr"] = g["lr"]
    criterion = OhemCrossEntropy(ignore_index=IGNORE, thresh=0.7, min_kept=100000)
    scaler = torch.cuda.amp.GradScaler(enabled=not args.no_amp)

    total_iters = args.epochs * len(train_loader)
    start_epoch, best_miou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model_state"])
        optimizer.load_state_dict(ckpt["optimizer_state"])
        scaler.load_state_dict(ckpt["scaler_state"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_score"]

    cur_itrs = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        tic = time.time()
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            if cur_itrs < args.warmup_iters:
                factor = (cur_itrs + 1) / args.warmup_iters
            else:
                factor = (1 - cur_itrs / total_iters) ** 0.9
            for g in optimizer.param_groups:
                g["lr"] = g["init_lr"] * factor

            with torch.cuda.amp.autocast(enabled=not args.no_amp):
                out = model(images)
                out = F.interpolate(out, size=labels.shape[-2:], mode="bilinear", align_corners=False)
                loss = criterion(out, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            cur_itrs += 1
            running[0] += loss.detach()
            running[1] += 1

        dist.all_reduce(running)
        if is_main:
            print(f"[epoch {epoch}] loss {running[0].item() / running[1].item():.4f} "
                  f"lr {optimizer.param_groups[1]['lr']:.5f} time {time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            score = validate(model.module, val_loader, device)
            if is_main:
                print(f"[epoch {epoch}] val mIoU {score['Mean IoU']:.4f} acc {score['Overall Acc']:.4f}")
                state = {
                    "epoch": epoch,
                    "model_state": model.module.state_dict(),
                    "optimizer_state": optimizer.state_dict(),
                    "scaler_state": scaler.state_dict(),
                    "best_score": max(best_miou, score["Mean IoU"]),
                }
                torch.save(state, os.path.join(args.ckpt_dir, "latest_deeplabv3plus_resnet101.pth"))
                if score["Mean IoU"] > best_miou:
                    best_miou = score["Mean IoU"]
                    torch.save(state, os.path.join(args.ckpt_dir, "best_deeplabv3plus_resnet101.pth"))
                    print(f"  new best mIoU {best_miou:.4f}")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
