"""Convert an ImageFolder dataset to FFCV .beton files (first run only) and train a ResNet on it.

torchrun --nproc_per_node=8 04_ffcv_write_and_train.py --data /data/imagenet --beton-dir /shared/ffcv
"""
import argparse
import json
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

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406]) * 255
IMAGENET_STD = np.array([0.229, 0.224, 0.225]) * 255


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--beton-dir", required=True)
    p.add_argument("--max-res", type=int, default=256)
    p.add_argument("--jpeg-quality", type=int, default=90)
    p.add_argument("--write-workers", type=int, default=32)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.5, help="per 256 images")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--res", type=int, default=176)
    p.add_argument("--val-res", type=int, default=224)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--log-dir", default="/shared/logs/ffcv_rn50")
    return p.parse_args()


def write_beton(out_path, split_dir, max_res, quality, workers):
    if os.path.exists(out_path):
        return
    ds = torchvision.datasets.ImageFolder(split_dir)
    writer = DatasetWriter(out_path, {
        "image": RGBImageField(write_mode="smart", max_resolution=max_res, jpeg_quality=quality),
        "label": IntField(),
    }, num_workers=workers)
    writer.from_indexed_dataset(ds, chunksize=100)


def make_loaders(args, local_rank):
    device = torch.device(f"cuda:{local_rank}")
    train_pipe = [
        RandomResizedCropRGBImageDecoder((args.res, args.res)),
        RandomHorizontalFlip(),
        ToTensor(),
        ToDevice(device, non_blocking=True),
        ToTorchImage(),
        NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16),
    ]
    val_pipe = [
        CenterCropRGBImageDecoder((args.val_res, args.val_res), ratio=224 / 256),
        ToTensor(),
        ToDevice(device, non_blocking=True),
        ToTorchImage(),
        NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16),
    ]

    def label_pipe():
        return [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)]

    train_loader = Loader(
        os.path.join(args.beton_dir, "train.beton"),
        batch_size=args.batch_size,
        num_workers=args.workers,
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=True,
        pipelines={"image": train_pipe, "label": label_pipe()},
        distributed=True,
    )
    val_loader = Loader(
        os.path.join(args.beton_dir, "val.beton"),
        batch_size=args.batch_size,
        num_workers=args.workers,
        order=OrderOption.SEQUENTIAL,
        drop_last=False,
        pipelines={"image": val_pipe, "label": label_pipe()},
        distributed=True,
    )
    return train_loader, val_loader


def lr_at(step, total, peak, warmup):
    # linear warmup, then linear decay to zero (ffcv rn50 recipe style)
    if step < warmup:
        return peak * step / warmup
    return peak * max(0.0, (total - step) / (total - warmup))


def evaluate(model, loader):
    model.eval()
    tot = torch.zeros(2, device="cuda")
    with torch.no_grad(), torch.autocast("cuda"):
        for images, target in loader:
            out = model(images)
            out = out + model(torch.flip(images, dims=[3]))  # flip TTA
            tot[0] += (out.argmax(1) == target).sum()
            tot[1] += target.shape[0]
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    os.makedirs(args.beton_dir, exist_ok=True)
    write_beton(os.path.join(args.beton_dir, "train.beton"), os.path.join(args.data, "train"),
                args.max_res, args.jpeg_quality, args.write_workers)
    write_beton(os.path.join(args.beton_dir, "val.beton"), os.path.join(args.data, "val"),
                args.max_res, args.jpeg_quality, args.write_workers)

    train_loader, val_loader = make_loaders(args, local_rank)

    model = getattr(torchvision.models, args.arch)()
    model = model.to(memory_format=torch.channels_last).cuda()
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.lr * args.batch_size * world / 256
    no_bn = [p for n, p in model.named_parameters() if "bn" not in n]
    bn = [p for n, p in model.named_parameters() if "bn" in n]
    optimizer = torch.optim.SGD([{"params": no_bn, "weight_decay": args.wd},
                                 {"params": bn, "weight_decay": 0.0}], lr=peak_lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup = 2 * steps_per_epoch
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        log_f = open(os.path.join(args.log_dir, "log.jsonl"), "a")

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for images, target in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, total_steps, peak_lr, warmup)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda"):
                loss = criterion(model(images), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1

        top1 = evaluate(model, val_loader)
        if rank == 0:
            rec = {"epoch": epoch, "top1": top1, "loss": loss.item(), "epoch_time": time.time() - t0}
            print(json.dumps(rec))
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            torch.save(model.module.state_dict(), os.path.join(args.log_dir, "final_weights.pt"))

    if rank == 0:
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
