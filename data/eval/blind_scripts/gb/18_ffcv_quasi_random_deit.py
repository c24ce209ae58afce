"""DeiT-S from scratch on ImageNet-21k-P (~11M images) with FFCV.

The .beton is ~1.4 TB, larger than host RAM, so the page cache is not used and
samples are read in QUASI_RANDOM order (random within large contiguous blocks).

torchrun --nproc_per_node=8 18_ffcv_quasi_random_deit.py --train /raid/in21k/train.beton --val /raid/in21k/val.beton
"""
import argparse
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP

from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--num-classes", type=int, default=10450)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--blr", type=float, default=5e-4, help="lr per 512 images")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--out", default="/raid/runs/deit_s_in21k")
    return p.parse_args()


def train_loader(path, batch_size, workers, device):
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=workers,
        order=OrderOption.QUASI_RANDOM,
        os_cache=False,
        drop_last=True,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(),
                      ToDevice(device, non_blocking=True), ToTorchImage(),
                      NormalizeImage(MEAN, STD, np.float16)],
            "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)],
        },
        batches_ahead=3,
    )


def val_loader(path, batch_size, workers, device):
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=workers,
        order=OrderOption.SEQUENTIAL,
        drop_last=False,
        distributed=True,
        pipelines={
            "image": [CenterCropRGBImageDecoder((224, 224), ratio=224 / 256), ToTensor(),
                      ToDevice(device, non_blocking=True), ToTorchImage(),
                      NormalizeImage(MEAN, STD, np.float16)],
            "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)],
        },
    )


def cosine(step, total, warmup, peak, floor=1e-6):
    if step < warmup:
        return peak * (step + 1) / warmup
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_dl = train_loader(args.train, args.batch_size, args.workers, device)
    val_dl = val_loader(args.val, 500, args.workers, device)

    model = timm.create_model("deit_small_patch16_224", num_classes=args.num_classes, drop_path_rate=0.1)
    model = DDP(model.to(device), device_ids=[local_rank])
    peak_lr = args.blr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=args.wd)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=args.num_classes)
    criterion = SoftTargetCrossEntropy()
    scaler = torch.cuda.amp.GradScaler()

    steps_per_epoch = len(train_dl)
    total = steps_per_epoch * args.epochs
    warmup = steps_per_epoch * args.warmup

    ckpt = os.path.join(args.out, "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optimizer"])
        scaler.load_state_dict(sd["scaler"])
        start_epoch = sd["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            step = epoch * steps_per_epoch + it
            for g in optimizer.param_groups:
                g["lr"] = cosine(step, total, warmup, peak_lr)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if it % 200 == 0:
                l = loss.detach().float()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"ep {epoch} {it}/{steps_per_epoch} loss {l.item() / world:.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

        model.eval()
        tally = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for x, y in val_dl:
                tally[0] += (model(x).argmax(-1) == y).sum()
                tally[1] += y.numel()
        dist.all_reduce(tally)
        if rank == 0:
            print(f"epoch {epoch} val top1 {100 * tally[0].item() / tally[1].item():.2f} "
                  f"epoch {time.time() - t0:.0f}s", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
