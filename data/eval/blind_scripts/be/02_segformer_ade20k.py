#!/usr/bin/env python
# SegFormer-B2 on ADE20K, 160k-iteration schedule, iteration-based training.
#
#   torchrun --nproc_per_node=8 02_segformer_ade20k.py --data /datasets/ADEChallengeData2016 \
#       --batch-size 2 --accum-steps 1 --out work_dirs/segformer_b2
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from segformer.model import SegFormer
from segformer.datasets import ADE20KDataset, build_train_transforms, build_val_transforms

logger = logging.getLogger("segformer")


def get_args():
    parser = argparse.ArgumentParser("SegFormer training")
    parser.add_argument("--data", required=True)
    parser.add_argument("--variant", default="mit_b2")
    parser.add_argument("--pretrained", default="pretrained/mit_b2.pth")
    parser.add_argument("--num-classes", type=int, default=150)
    parser.add_argument("--crop-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--max-iters", type=int, default=160000)
    parser.add_argument("--warmup-iters", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=6e-5)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-interval", type=int, default=16000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--resume", default="")
    parser.add_argument("--out", default="work_dirs/segformer")
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


def setup_distributed():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return rank, local_rank, world_size


class ShardSampler(torch.utils.data.Sampler):
    """Every rank gets a strided slice of the val set, no padding / duplicates."""

    def __init__(self, dataset, rank, world_size):
        self.indices = list(range(rank, len(dataset), world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def poly_lr(base_lr, it, max_iters, warmup_iters, power=1.0, warmup_ratio=1e-6):
    if it < warmup_iters:
        k = (1 - it / warmup_iters) * (1 - warmup_ratio)
        return base_lr * (1 - k)
    return base_lr * (1 - (it - warmup_iters) / (max_iters - warmup_iters)) ** power


def build_optimizer(model, lr, wd):
    # 10x lr for the decode head, no weight decay on norms / pos-block
    head, backbone_decay, backbone_no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("decode_head"):
            head.append(p)
        elif p.ndim == 1 or "norm" in name or "pos_block" in name:
            backbone_no_decay.append(p)
        else:
            backbone_decay.append(p)
    groups = [
        {"params": backbone_decay, "lr": lr, "weight_decay": wd},
        {"params": backbone_no_decay, "lr": lr, "weight_decay": 0.0},
        {"params": head, "lr": lr * 10, "weight_decay": wd},
    ]
    for g in groups:
        g["base_lr"] = g["lr"]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))


@torch.no_grad()
def evaluate(net, loader, num_classes, device, crop=512, stride=341):
    net.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    for img, label in loader:
        img = img.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        _, _, H, W = img.shape
        logits = torch.zeros(1, num_classes, H, W, device=device)
        count = torch.zeros(1, 1, H, W, device=device)
        h_grids = max(H - crop + stride - 1, 0) // stride + 1
        w_grids = max(W - crop + stride - 1, 0) // stride + 1
        for hi in range(h_grids):
            for wi in range(w_grids):
                y1, x1 = hi * stride, wi * stride
                y2, x2 = min(y1 + crop, H), min(x1 + crop, W)
                y1, x1 = max(y2 - crop, 0), max(x2 - crop, 0)
                out = net(img[:, :, y1:y2, x1:x2])
                out = F.interpolate(out, size=(y2 - y1, x2 - x1), mode="bilinear", align_corners=False)
                logits[:, :, y1:y2, x1:x2] += out
                count[:, :, y1:y2, x1:x2] += 1
        pred = (logits / count).argmax(1)
        valid = label != 255
        idx = label[valid] * num_classes + pred[valid]
        hist += torch.bincount(idx, minlength=num_classes ** 2).reshape(num_classes, num_classes).double()
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    acc = hist.diag().sum() / hist.sum().clamp(min=1)
    net.train()
    return iou.mean().item(), acc.item(), iou.cpu().numpy()


def main():
    args = get_args()
    rank, local_rank, world_size = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(42 + rank)
    np.random.seed(42 + rank)

    train_set = ADE20KDataset(args.data, split="training", transforms=build_train_transforms(args.crop_size))
    val_set = ADE20KDataset(args.data, split="validation", transforms=build_val_transforms())
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=ShardSampler(val_set, rank, world_size),
                            num_workers=2, pin_memory=True)

    model = SegFormer(args.variant, num_classes=args.num_classes)
    if args.pretrained and not args.resume:
        state = torch.load(args.pretrained, map_location="cpu")
        missing, unexpected = model.backbone.load_state_dict(state, strict=False)
        logger.info("backbone: %d missing, %d unexpected keys", len(missing), len(unexpected))
    # the all-MLP decoder has one BN in the fuse layer; 2 imgs/GPU is too small for it
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)

    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_iter, best_miou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_miou = ckpt["iter"], ckpt["best_miou"]
        logger.info("resumed from %s at iter %d", args.resume, start_iter)

    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    criterion = nn.CrossEntropyLoss(ignore_index=255)

    it = start_iter
    epoch = it // max(len(train_loader) // args.accum_steps, 1)
    model.train()
    t0 = time.time()
    while it < args.max_iters:
        train_sampler.set_epoch(epoch)
        for step, (img, label) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True).long()
            last_micro = (step + 1) % args.accum_steps == 0
            # skip the gradient all-reduce on the intermediate micro-batches
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                with torch.cuda.amp.autocast(enabled=args.amp):
                    logits = model(img)
                    logits = F.interpolate(logits, size=label.shape[-2:], mode="bilinear", align_corners=False)
                    loss = criterion(logits, label) / args.accum_steps
                scaler.scale(loss).backward()
            if not last_micro:
                continue

            for g in optimizer.param_groups:
                g["lr"] = poly_lr(g["base_lr"], it, args.max_iters, args.warmup_iters)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            it += 1

            if it % 50 == 0:
                loss_log = loss.detach() * args.accum_steps
                dist.all_reduce(loss_log)
                loss_log /= world_size
                if rank == 0:
                    writer.add_scalar("train/loss", loss_log.item(), it)
                    writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], it)
                    logger.info("iter %d/%d loss %.4f lr %.2e (%.2fs/it)", it, args.max_iters,
                                loss_log.item(), optimizer.param_groups[0]["lr"], (time.time() - t0) / 50)
                t0 = time.time()

            if it % args.eval_interval == 0 or it == args.max_iters:
                miou, acc, per_class = evaluate(model.module, val_loader, args.num_classes, device, args.crop_size)
                if rank == 0:
                    writer.add_scalar("val/mIoU", miou, it)
                    writer.add_scalar("val/aAcc", acc, it)
                    logger.info("iter %d: mIoU %.2f aAcc %.2f", it, miou * 100, acc * 100)
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "iter": it, "best_miou": max(best_miou, miou)}
                    torch.save(state, os.path.join(args.out, "latest.pth"))
                    if miou > best_miou:
                        torch.save(state, os.path.join(args.out, "best_mIoU.pth"))
                best_miou = max(best_miou, miou)
                dist.barrier()
            if it >= args.max_iters:
                break
        epoch += 1

    if rank == 0:
        writer.close()
        logger.info("done, best mIoU %.2f", best_miou * 100)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
