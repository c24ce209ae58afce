#!/usr/bin/env python3
"""YOLOX-S trainer (mosaic + mixup, multi-scale, EMA, no-aug last epochs).

torchrun --nproc_per_node 8 08_yolox_train.py --data-dir datasets/COCO -b 64 --fp16 --cache
"""
import argparse
import contextlib
import datetime
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from yolox.data import COCODataset, MosaicDetection, TrainTransform, ValTransform, yolox_collate
from yolox.evaluators import COCOEvaluator
from yolox.models import YOLOX, YOLOPAFPN, YOLOXHead
from yolox.utils import ModelEMA, get_model_info


def make_parser():
    p = argparse.ArgumentParser("YOLOX train")
    p.add_argument("--data-dir", default="datasets/COCO")
    p.add_argument("-b", "--batch-size", type=int, default=64, help="total batch size over all gpus")
    p.add_argument("--max-epoch", type=int, default=300)
    p.add_argument("--no-aug-epochs", type=int, default=15)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--basic-lr-per-img", type=float, default=0.01 / 64.0)
    p.add_argument("--input-size", type=int, nargs=2, default=[640, 640])
    p.add_argument("--multiscale-range", type=int, default=5)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--cache", action="store_true", help="cache decoded images in RAM")
    p.add_argument("--output", default="YOLOX_outputs/yolox_s")
    p.add_argument("--resume", default="")
    return p


@contextlib.contextmanager
def main_process_first(local_rank):
    """Rank 0 of every node goes first (e.g. to build the annotation / image cache)."""
    if local_rank != 0:
        dist.barrier()
    yield
    if local_rank == 0:
        dist.barrier()


class InferenceSampler(torch.utils.data.Sampler):
    """Contiguous, unpadded shard of the val set (DistributedSampler would repeat images)."""

    def __init__(self, size, rank, world_size):
        per = (size + world_size - 1) // world_size
        self.indices = list(range(rank * per, min(size, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def random_resize(input_size, multiscale_range, rank, device):
    tensor = torch.zeros(2, dtype=torch.long, device=device)
    if rank == 0:
        size_factor = input_size[1] / input_size[0]
        min_size = int(input_size[0] / 32) - multiscale_range
        max_size = int(input_size[0] / 32) + multiscale_range
        size = random.randint(min_size, max_size)
        tensor[0], tensor[1] = 32 * size, 32 * int(size * size_factor)
    dist.broadcast(tensor, 0)  # every rank trains on the same shape this interval
    return int(tensor[0]), int(tensor[1])


def preprocess(inputs, targets, tsize, input_size):
    scale_y, scale_x = tsize[0] / input_size[0], tsize[1] / input_size[1]
    if scale_x != 1 or scale_y != 1:
        inputs = F.interpolate(inputs, size=tsize, mode="bilinear", align_corners=False)
        targets[..., 1::2] = targets[..., 1::2] * scale_x
        targets[..., 2::2] = targets[..., 2::2] * scale_y
    return inputs, targets


def lr_at(iters, total_iters, warmup_iters, no_aug_iters, lr, min_lr_ratio=0.05):
    min_lr = lr * min_lr_ratio
    if iters <= warmup_iters:
        return lr * pow(iters / float(warmup_iters), 2)  # yoloxwarmcos
    if iters >= total_iters - no_aug_iters:
        return min_lr
    return min_lr + 0.5 * (lr - min_lr) * (
        1.0 + math.cos(math.pi * (iters - warmup_iters) / (total_iters - warmup_iters - no_aug_iters)))


def main():
    args = make_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)  # different mosaic crops per rank
    np.random.seed(rank)

    assert args.batch_size % world_size == 0
    per_gpu = args.batch_size // world_size
    lr = args.basic_lr_per_img * args.batch_size  # linear scaling with the total batch

    writer = SummaryWriter(args.output) if rank == 0 else None

    # annotation + image cache is written once by local rank 0, the others then read it
    with main_process_first(local_rank):
        train_base = COCODataset(args.data_dir, json_file="instances_train2017.json", name="train2017",
                                 img_size=tuple(args.input_size), cache=args.cache,
                                 preproc=TrainTransform(max_labels=50, flip_prob=0.5, hsv_prob=1.0))
        val_set = COCODataset(args.data_dir, json_file="instances_val2017.json", name="val2017",
                              img_size=(640, 640), preproc=ValTransform(legacy=False))
    train_set = MosaicDetection(train_base, mosaic=True, img_size=tuple(args.input_size),
                                preproc=TrainTransform(max_labels=120, flip_prob=0.5, hsv_prob=1.0),
                                degrees=10.0, translate=0.1, mosaic_scale=(0.1, 2), mixup_scale=(0.5, 1.5),
                                shear=2.0, enable_mixup=True)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, collate_fn=yolox_collate)
    val_loader = DataLoader(val_set, batch_size=per_gpu, sampler=InferenceSampler(len(val_set), rank, world_size),
                            num_workers=4, pin_memory=True, collate_fn=yolox_collate)
    evaluator = COCOEvaluator(val_loader, img_size=(640, 640), confthre=0.001, nmsthre=0.65, num_classes=80)

    in_channels = [256, 512, 1024]
    model = YOLOX(YOLOPAFPN(0.33, 0.50, in_channels=in_channels), YOLOXHead(80, 0.50, in_channels=in_channels))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps, m.momentum = 1e-3, 0.03
    model.head.initialize_biases(1e-2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # 8 imgs/GPU, keep BN stats identical on all ranks
    model.to(device)

    pg0, pg1, pg2 = [], [], []
    for k, v in model.named_modules():
        if hasattr(v, "bias") and isinstance(v.bias, nn.Parameter):
            pg2.append(v.bias)
        if isinstance(v, (nn.BatchNorm2d, nn.SyncBatchNorm)) or "bn" in k:
            pg0.append(v.weight)
        elif hasattr(v, "weight") and isinstance(v.weight, nn.Parameter):
            pg1.append(v.weight)
    optimizer = torch.optim.SGD(pg0, lr=lr, momentum=0.9, nesterov=True)
    optimizer.add_param_group({"params": pg1, "weight_decay": 5e-4})
    optimizer.add_param_group({"params": pg2})

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_ap = ckpt["start_epoch"], ckpt.get("best_ap", 0.0)

    ema_model = ModelEMA(model, 0.9998)  # built from the bare model, before DDP
    if args.resume:
        ema_model.ema.load_state_dict(ckpt["ema"])
        ema_model.updates = ckpt["ema_updates"]
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    iters_per_epoch = len(train_loader)
    total_iters = iters_per_epoch * args.max_epoch
    warmup_iters = iters_per_epoch * args.warmup_epochs
    no_aug_iters = iters_per_epoch * args.no_aug_epochs
    input_size = tuple(args.input_size)
    if rank == 0:
        print(get_model_info(model.module, input_size))

    for epoch in range(start_epoch, args.max_epoch):
        if epoch == args.max_epoch - args.no_aug_epochs or (
                start_epoch > args.max_epoch - args.no_aug_epochs and epoch == start_epoch):
            # same decision on every rank: it only depends on the epoch index
            train_set.close_mosaic()
            model.module.head.use_l1 = True
        sampler.set_epoch(epoch)
        model.train()
        t_epoch = time.time()
        for it, (inps, targets, _, _) in enumerate(train_loader):
            progress = epoch * iters_per_epoch + it
            inps = inps.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            targets.requires_grad = False
            inps, targets = preprocess(inps, targets, input_size, tuple(args.input_size))
            with torch.cuda.amp.autocast(enabled=args.fp16):
                outputs = model(inps, targets)
            loss = outputs["total_loss"]
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema_model.update(model)  # ModelEMA unwraps .module itself

            cur_lr = lr_at(progress + 1, total_iters, warmup_iters, no_aug_iters, lr)
            for g in optimizer.param_groups:
                g["lr"] = cur_lr

            if (progress + 1) % 10 == 0:
                input_size = random_resize(args.input_size, args.multiscale_range, rank, device)
            if rank == 0 and (it + 1) % 50 == 0:
                writer.add_scalar("train/total_loss", loss.item(), progress + 1)
                writer.add_scalar("train/lr", cur_lr, progress + 1)
                print(f"epoch {epoch + 1}/{args.max_epoch} iter {it + 1}/{iters_per_epoch} "
                      f"loss {loss.item():.3f} iou {outputs['iou_loss'].item():.3f} lr {cur_lr:.3e} "
                      f"size {input_size[0]}")

        if rank == 0:
            print(f"epoch {epoch + 1} took {time.time() - t_epoch:.0f}s")

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.max_epoch:
            # each rank runs its shard; the evaluator gathers the detections to every rank
            ap50_95, ap50, summary = evaluator.evaluate(ema_model.ema, distributed=True, half=args.fp16)
            stats = torch.tensor([ap50_95, ap50], device=device)
            dist.broadcast(stats, 0)  # rank 0's COCOeval result is the reference
            ap50_95, ap50 = stats.tolist()
            is_best = ap50_95 > best_ap
            best_ap = max(best_ap, ap50_95)
            if rank == 0:
                writer.add_scalar("val/COCOAP50", ap50, epoch + 1)
                writer.add_scalar("val/COCOAP50_95", ap50_95, epoch + 1)
                print(summary)
                ckpt_state = {"start_epoch": epoch + 1, "model": model.module.state_dict(),
                              "ema": ema_model.ema.state_dict(), "ema_updates": ema_model.updates,
                              "optimizer": optimizer.state_dict(), "best_ap": best_ap}
                os.makedirs(args.output, exist_ok=True)
                torch.save(ckpt_state, os.path.join(args.output, "latest_ckpt.pth"))
                if is_best:
                    torch.save(ckpt_state, os.path.join(args.output, "best_ckpt.pth"))
            dist.barrier()

    if rank == 0:
        writer.close()
        print(f"Training done, best AP {best_ap * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
