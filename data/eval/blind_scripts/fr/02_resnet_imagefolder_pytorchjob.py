#!/usr/bin/env python
# ResNet-50 training on the product-image dataset.
# Submitted as a PyTorchJob (training-operator), Master x1 + Worker x3, 8 GPUs per pod:
#   command: ["torchrun", "--nnodes=4", "--nproc_per_node=8",
#             "--rdzv_backend=c10d", "--rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT)",
#             "/app/train_cls.py", "--data", "/data/products", "--output", "/ckpt/resnet50"]
# /data is the S3 bucket mounted through the s3-csi driver, /ckpt is an FSx for Lustre PVC.
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, models, transforms

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=0.1, help="for a global batch of 256")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--amp", action="store_true")
    return ap.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_loaders(args, rank, world):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        norm,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        norm,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # every validation image is scored exactly once: strided shards, no padding
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, batch_size=128, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler, len(train_set.classes)


def adjust_lr(optimizer, epoch, it, iters_per_epoch, args, peak_lr):
    if epoch < args.warmup_epochs:
        lr = peak_lr * (epoch * iters_per_epoch + it + 1) / (args.warmup_epochs * iters_per_epoch)
    else:
        lr = peak_lr * (0.1 ** ((epoch - args.warmup_epochs) // 30))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct@1, correct@5, count
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        top5 = output.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(dim=1).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100


def save_checkpoint(path, model, optimizer, scaler, epoch, best_acc):
    tmp = path + ".partial"
    torch.save({
        "epoch": epoch,
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "best_acc": best_acc,
    }, tmp)
    os.replace(tmp, path)


def main():
    args = get_args()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_loader, val_loader, train_sampler, num_classes = build_loaders(args, rank, world)

    model = models.__dict__[args.arch](num_classes=num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    peak_lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).to(device)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_acc = 0, 0.0
    last_path = os.path.join(args.output, "checkpoint.pth")
    if os.path.isfile(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        log.info("resuming at epoch %d (best top1 %.2f)", start_epoch, best_acc)

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))

    iters = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, (images, target) in enumerate(train_loader):
            lr = adjust_lr(optimizer, epoch, it, iters, args, peak_lr)
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running[0] += loss.detach()
            running[1] += 1
            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f lr %.4f", epoch, it, iters, loss.item(), lr)

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        top1, top5 = validate(model, val_loader, device)
        log.info("epoch %d train_loss %.4f top1 %.2f top5 %.2f (%.0fs)",
                 epoch, train_loss, top1, top5, time.time() - t0)

        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            is_best = top1 > best_acc
            best_acc = max(best_acc, top1)
            save_checkpoint(last_path, model, optimizer, scaler, epoch, best_acc)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(args.output, "model_best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
