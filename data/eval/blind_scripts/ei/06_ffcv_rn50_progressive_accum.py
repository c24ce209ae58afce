"""FFCV ResNet-50 with progressive resizing, LARS and gradient accumulation.

Effective batch = batch_size * accum * world_size. Accumulation steps skip the
gradient all-reduce via DDP.no_sync().

    torchrun --nproc_per_node=8 06_ffcv_rn50_progressive_accum.py \
        --train /data/ffcv/train_500_0.50_90.beton --val /data/ffcv/val_500_0.50_90.beton
"""
import argparse
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import (NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice,
                             ToTensor, ToTorchImage)

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406]) * 255
IMAGENET_STD = np.array([0.229, 0.224, 0.225]) * 255
DEFAULT_CROP_RATIO = 224 / 256


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--epochs", type=int, default=88)
    p.add_argument("--batch-size", type=int, default=512, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.5, help="per 256 images")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--min-res", type=int, default=160)
    p.add_argument("--max-res", type=int, default=192)
    p.add_argument("--end-ramp", type=int, default=76)
    p.add_argument("--val-res", type=int, default=256)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--in-memory", action="store_true")
    p.add_argument("--log-dir", default="/nfs/bench/ffcv_rn50")
    p.add_argument("--resume", default="")
    return p.parse_args()


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum=0.9, eta=0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta, weight_decay=0.0))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad.add(p, alpha=wd) if wd else p.grad
                if group.get("lars", True):
                    w_norm, g_norm = p.norm(), d_p.norm()
                    trust = torch.where((w_norm > 0) & (g_norm > 0),
                                        group["eta"] * w_norm / g_norm, torch.ones_like(w_norm))
                    d_p = d_p * trust
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(d_p)
                p.add_(buf, alpha=-group["lr"])


def get_res(epoch, args):
    if epoch >= args.end_ramp:
        return args.max_res
    start_ramp = args.end_ramp - 10
    if epoch <= start_ramp:
        return args.min_res
    interp = np.interp([epoch], [start_ramp, args.end_ramp], [args.min_res, args.max_res])
    return int(np.round(interp[0] / 32)) * 32


def create_loaders(args, device):
    train_decoder = RandomResizedCropRGBImageDecoder((args.min_res, args.min_res))
    train_img = [train_decoder, RandomHorizontalFlip(), ToTensor(),
                 ToDevice(device, non_blocking=True), ToTorchImage(),
                 NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16)]
    val_img = [CenterCropRGBImageDecoder((args.val_res, args.val_res), ratio=DEFAULT_CROP_RATIO),
               ToTensor(), ToDevice(device, non_blocking=True), ToTorchImage(),
               NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16)]
    label = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)]

    # FFCV shards per rank itself and reseeds the order every epoch
    train_loader = Loader(args.train, batch_size=args.batch_size, num_workers=args.workers,
                          order=OrderOption.RANDOM, os_cache=args.in_memory, drop_last=True,
                          pipelines={"image": train_img, "label": label}, distributed=True)
    val_loader = Loader(args.val, batch_size=args.batch_size, num_workers=args.workers,
                        order=OrderOption.SEQUENTIAL, drop_last=False,
                        pipelines={"image": val_img, "label": label}, distributed=True)
    return train_loader, val_loader, train_decoder


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    totals = torch.zeros(3, device="cuda")
    for images, target in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
            out = out + model(torch.flip(images, dims=[3]))  # flip TTA
        totals[0] += (out.argmax(1) == target).sum()
        totals[1] += (out.topk(5, 1).indices == target[:, None]).any(1).sum()
        totals[2] += target.shape[0]
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_loader, val_loader, train_decoder = create_loaders(args, device)

    model = torchvision.models.resnet50()
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    bn_bias = [p for n, p in model.named_parameters() if p.ndim <= 1]
    weights = [p for n, p in model.named_parameters() if p.ndim > 1]
    eff_batch = args.batch_size * args.accum * world
    peak_lr = args.lr * eff_batch / 256
    optimizer = LARS([{"params": weights, "weight_decay": args.wd},
                      {"params": bn_bias, "weight_decay": 0.0, "lars": False}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    iters = len(train_loader)
    steps_per_epoch = iters // args.accum
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * args.warmup_epochs
    lr_grid = np.interp(np.arange(total_steps + 1), [0, warmup_steps, total_steps],
                        [peak_lr * 0.01, peak_lr, 0.0])

    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        print(f"eff batch {eff_batch} peak lr {peak_lr:.2f} steps/epoch {steps_per_epoch}",
              flush=True)

    for epoch in range(start_epoch, args.epochs):
        res = get_res(epoch, args)
        train_decoder.output_size = (res, res)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            last_micro = (i + 1) % args.accum == 0
            ctx = nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(images), target) / args.accum
                scaler.scale(loss).backward()
            if not last_micro:
                continue
            step = epoch * steps_per_epoch + i // args.accum
            for g in optimizer.param_groups:
                g["lr"] = lr_grid[step]
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        torch.cuda.synchronize()
        epoch_time = time.time() - t0
        top1, top5 = evaluate(model, val_loader)
        if rank == 0:
            rec = {"epoch": epoch, "res": res, "top1": top1, "top5": top5,
                   "epoch_time": epoch_time,
                   "img_per_s": iters * args.batch_size * world / epoch_time}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.log_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.log_dir, "ckpt.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
