#!/usr/bin/env python3
"""EfficientNet-B0 / FusedLAMB, DALI-decoded input, fp16 + channels_last.

Input pipeline benchmark variant: all JPEG decoding on the GPU (nvJPEG via DALI
'mixed' decoder) so the CPUs stay free.

    torchrun --nproc_per_node=8 12_dali_effnet_fusedlamb.py --data /raid/imagenet
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import timm
from apex.optimizers import FusedLAMB
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/raid/imagenet")
    ap.add_argument("--model", default="efficientnet_b0")
    ap.add_argument("--epochs", type=int, default=350)
    ap.add_argument("--batch-size", type=int, default=512, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.016, help="per 1024 images")
    ap.add_argument("--wd", type=float, default=1e-2)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--train-size", type=int, default=224)
    ap.add_argument("--eval-size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--out", default="/raid/ckpt/effnet_b0_lamb")
    ap.add_argument("--log-every", type=int, default=100)
    return ap.parse_args()


@pipeline_def
def train_pipe(data_dir, size, shard_id, num_shards):
    jpegs, labels = fn.readers.file(file_root=data_dir, shard_id=shard_id, num_shards=num_shards,
                                    random_shuffle=True, pad_last_batch=True, name="Reader")
    images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                           random_area=[0.08, 1.0],
                                           random_aspect_ratio=[0.75, 1.333])
    images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_CUBIC)
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW",
                                      mean=MEAN, std=STD,
                                      mirror=fn.random.coin_flip(probability=0.5))
    return images, labels.gpu()


@pipeline_def
def val_pipe(data_dir, size, shard_id, num_shards):
    jpegs, labels = fn.readers.file(file_root=data_dir, shard_id=shard_id, num_shards=num_shards,
                                    random_shuffle=False, pad_last_batch=True, name="Reader")
    images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
    images = fn.resize(images, resize_shorter=int(size / 0.875), interp_type=types.INTERP_CUBIC)
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW",
                                      crop=(size, size), mean=MEAN, std=STD)
    return images, labels.gpu()


def dali_loader(pipe_fn, data_dir, batch_size, threads, size, shard_id, num_shards, train,
                device_id=0):
    pipe = pipe_fn(batch_size=batch_size, num_threads=threads, device_id=device_id,
                   seed=42 + shard_id, data_dir=data_dir, size=size,
                   shard_id=shard_id, num_shards=num_shards)
    pipe.build()
    return DALIClassificationIterator(
        pipe, reader_name="Reader", auto_reset=True,
        last_batch_policy=LastBatchPolicy.DROP if train else LastBatchPolicy.PARTIAL)


def cosine(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    res = torch.zeros(2, device="cuda")
    for batch in loader:
        x = batch[0]["data"].contiguous(memory_format=torch.channels_last)
        y = batch[0]["label"].squeeze(-1).long()
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(1)
        res[0] += (pred == y).sum()
        res[1] += y.numel()
    dist.all_reduce(res)
    return (res[0] / res[1]).item() * 100


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    train_loader = dali_loader(train_pipe, os.path.join(args.data, "train"), args.batch_size,
                               args.threads, args.train_size, rank, world, train=True)
    val_loader = dali_loader(val_pipe, os.path.join(args.data, "val"), 256,
                             args.threads, args.eval_size, rank, world, train=False)

    model = timm.create_model(args.model, num_classes=1000, drop_rate=0.2, drop_path_rate=0.2)
    model = model.cuda().to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.lr * args.batch_size * world / 1024
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = FusedLAMB([{"params": decay, "weight_decay": args.wd},
                           {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    iters = len(train_loader)
    total = args.epochs * iters
    warmup = args.warmup_epochs * iters
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {args.batch_size * world}, lr {peak_lr:.4f}, {iters} it/epoch",
              flush=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, batch in enumerate(train_loader):
            x = batch[0]["data"].contiguous(memory_format=torch.channels_last)
            y = batch[0]["label"].squeeze(-1).long()
            lr = cosine(step, total, warmup, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if rank == 0 and i % args.log_every == 0:
                torch.cuda.synchronize()
                ips = (i + 1) * args.batch_size * world / (time.perf_counter() - t0)
                print(f"epoch {epoch} {i}/{iters} loss {loss.item():.4f} lr {lr:.5f} "
                      f"{ips:.0f} img/s", flush=True)

        torch.cuda.synchronize()
        ep_time = time.perf_counter() - t0
        top1 = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} "
                  f"throughput {iters * args.batch_size * world / ep_time:.0f} img/s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
