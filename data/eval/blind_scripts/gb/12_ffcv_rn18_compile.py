"""ResNet-18, 16 epochs, FFCV loaders + torch.compile on a single 8-GPU node.

The .beton files are created on first use (rank 0 writes, others wait).

torchrun --standalone --nproc_per_node=8 12_ffcv_rn18_compile.py --imagenet /data/imagenet --betons /scratch/betons
"""
import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from ffcv.fields import IntField, RGBImageField
from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage
from ffcv.writer import DatasetWriter

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--imagenet", required=True)
    p.add_argument("--betons", required=True)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=512, help="per GPU")
    p.add_argument("--lr", type=float, default=0.5, help="per 256 images")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--res", type=int, default=160)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--ckpt", default="/scratch/rn18_ffcv/ckpt.pt")
    return p.parse_args()


def ensure_betons(args, rank):
    paths = {s: os.path.join(args.betons, f"{s}_256_q90.beton") for s in ("train", "val")}
    if rank == 0:
        os.makedirs(args.betons, exist_ok=True)
        for split, path in paths.items():
            if os.path.exists(path):
                continue
            ds = torchvision.datasets.ImageFolder(os.path.join(args.imagenet, split))
            writer = DatasetWriter(path + ".tmp", {
                "image": RGBImageField(write_mode="smart", max_resolution=256, jpeg_quality=90),
                "label": IntField(),
            }, num_workers=64)
            writer.from_indexed_dataset(ds, chunksize=100)
            os.replace(path + ".tmp", path)
    dist.barrier()
    return paths


def loaders(paths, args, device):
    train = Loader(
        paths["train"], batch_size=args.batch_size, num_workers=args.workers,
        order=OrderOption.RANDOM, os_cache=True, drop_last=True, distributed=True,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((args.res, args.res)), RandomHorizontalFlip(),
                      ToTensor(), ToDevice(device, non_blocking=True), ToTorchImage(),
                      NormalizeImage(MEAN, STD, np.float16)],
            "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)],
        },
    )
    val = Loader(
        paths["val"], batch_size=256, num_workers=args.workers, order=OrderOption.SEQUENTIAL,
        os_cache=True, drop_last=False, distributed=True,
        pipelines={
            "image": [CenterCropRGBImageDecoder((224, 224), ratio=224 / 256), ToTensor(),
                      ToDevice(device, non_blocking=True), ToTorchImage(),
                      NormalizeImage(MEAN, STD, np.float16)],
            "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)],
        },
    )
    return train, val


def triangular_lr(it, total, peak, warm_frac=0.125):
    warm = int(total * warm_frac)
    if it < warm:
        return peak * (it + 1) / warm
    return peak * (total - it) / (total - warm)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # long timeout: on the first run rank 0 spends a while writing the .beton files
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(hours=4))
    rank, world = dist.get_rank(), dist.get_world_size()

    paths = ensure_betons(args, rank)
    train_loader, val_loader = loaders(paths, args, device)

    # 512 images per GPU: per-GPU BatchNorm statistics are fine here
    net = torchvision.models.resnet18().to(device, memory_format=torch.channels_last)
    ddp = DDP(net, device_ids=[local_rank], static_graph=True)
    model = torch.compile(ddp)

    peak = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(ddp.parameters(), lr=peak, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    start = 0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location="cpu")
        ddp.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    iters = len(train_loader)
    total = iters * args.epochs
    for epoch in range(start, args.epochs):
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            it = epoch * iters + i
            for g in opt.param_groups:
                g["lr"] = triangular_lr(it, total, peak)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        torch.cuda.synchronize()
        train_time = time.time() - t0

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for x, y in val_loader:
                acc[0] += (ddp.module(x).argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)

        if rank == 0:
            print(f"epoch {epoch} top1 {100 * acc[0].item() / acc[1].item():.2f} "
                  f"train {train_time:.1f}s ({iters * args.batch_size * world / train_time:.0f} img/s)",
                  flush=True)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
