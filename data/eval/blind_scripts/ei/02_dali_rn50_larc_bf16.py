#!/usr/bin/env python3
# RN50 throughput + convergence benchmark, DALI input pipeline, LARC, bf16.
#
#   torchrun --nproc_per_node=8 02_dali_rn50_larc_bf16.py --data /raid/imagenet --epochs 40
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from apex.parallel.LARC import LARC
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="ImageNet root with train/ and val/")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("-b", "--batch-size", type=int, default=256, help="images per GPU")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD lr per 256 images before LARC")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=5e-5)
    parser.add_argument("--trust-coefficient", type=float, default=0.001)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dali-threads", type=int, default=4)
    parser.add_argument("--dali-cpu", action="store_true")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--val-size", type=int, default=256)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--ckpt-dir", default="/shared/bench/rn50_larc")
    return parser.parse_args()


@pipeline_def
def imagenet_pipe(data_dir, crop, size, shard_id, num_shards, is_training, dali_cpu=False):
    jpegs, labels = fn.readers.file(file_root=data_dir, shard_id=shard_id, num_shards=num_shards,
                                    random_shuffle=is_training, pad_last_batch=True, name="Reader")
    dali_device = "cpu" if dali_cpu else "gpu"
    decoder_device = "cpu" if dali_cpu else "mixed"
    if is_training:
        images = fn.decoders.image_random_crop(jpegs, device=decoder_device, output_type=types.RGB,
                                               device_memory_padding=211025920,
                                               host_memory_padding=140544512,
                                               random_aspect_ratio=[0.75, 4.0 / 3.0],
                                               random_area=[0.08, 1.0], num_attempts=100)
        images = fn.resize(images, device=dali_device, resize_x=crop, resize_y=crop,
                           interp_type=types.INTERP_TRIANGULAR)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
        images = fn.resize(images, device=dali_device, size=size, mode="not_smaller",
                           interp_type=types.INTERP_TRIANGULAR)
        mirror = False
    images = fn.crop_mirror_normalize(images.gpu(), dtype=types.FLOAT, output_layout="HWC",
                                      crop=(crop, crop),
                                      mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                      std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                                      mirror=mirror)
    return images, labels.gpu()


def make_loader(args, split, is_training, local_rank, rank, world_size):
    pipe = imagenet_pipe(batch_size=args.batch_size, num_threads=args.dali_threads,
                         device_id=local_rank, seed=1234 + rank,
                         data_dir=os.path.join(args.data, split), crop=args.crop,
                         size=args.val_size, shard_id=rank, num_shards=world_size,
                         is_training=is_training, dali_cpu=args.dali_cpu)
    pipe.build()
    policy = LastBatchPolicy.DROP if is_training else LastBatchPolicy.PARTIAL
    return DALIClassificationIterator(pipe, reader_name="Reader", last_batch_policy=policy,
                                      auto_reset=True)


def exclude_from_wd(model, wd):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def adjust_lr(optimizer, step, steps_per_epoch, args, peak_lr):
    warm = args.warmup * steps_per_epoch
    total = args.epochs * steps_per_epoch
    if step < warm:
        lr = peak_lr * (step + 1) / warm
    else:
        # polynomial (power 2) decay, as in the MLPerf LARS reference
        lr = peak_lr * (1.0 - (step - warm) / (total - warm)) ** 2
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


@torch.no_grad()
def validate(model, loader):
    model.eval()
    correct = torch.zeros((), device="cuda")
    count = torch.zeros((), device="cuda")
    for data in loader:
        # DALI gives NHWC; permute is free with channels_last
        images = data[0]["data"].permute(0, 3, 1, 2)
        labels = data[0]["label"].squeeze(-1).long()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        correct += (logits.argmax(1) == labels).sum()
        count += labels.numel()
    # PARTIAL + reader_name strips the padded samples, so counts are exact
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item() * 100.0


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    train_loader = make_loader(args, "train", True, local_rank, rank, world_size)
    val_loader = make_loader(args, "val", False, local_rank, rank, world_size)
    steps_per_epoch = len(train_loader)

    model = torchvision.models.resnet50(zero_init_residual=True)
    model = model.cuda().to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    peak_lr = args.lr * args.batch_size * world_size / 256
    base_opt = torch.optim.SGD(exclude_from_wd(model.module, args.wd), lr=peak_lr,
                               momentum=args.momentum)
    optimizer = LARC(base_opt, trust_coefficient=args.trust_coefficient, clip=False)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1).cuda()

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{world_size} GPUs, {steps_per_epoch} it/epoch, global batch "
              f"{args.batch_size * world_size}, peak lr {peak_lr:.2f}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        torch.cuda.synchronize()
        t_epoch = time.perf_counter()
        t_window = t_epoch
        for i, data in enumerate(train_loader):
            images = data[0]["data"].permute(0, 3, 1, 2)
            labels = data[0]["label"].squeeze(-1).long()
            lr = adjust_lr(optimizer, step, steps_per_epoch, args, peak_lr)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if (i + 1) % args.print_freq == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced)
                torch.cuda.synchronize()
                now = time.perf_counter()
                ips = args.print_freq * args.batch_size * world_size / (now - t_window)
                t_window = now
                if rank == 0:
                    print(f"[{epoch}][{i + 1}/{steps_per_epoch}] loss {reduced.item() / world_size:.4f} "
                          f"lr {lr:.3f} {ips:.0f} img/s", flush=True)

        torch.cuda.synchronize()
        epoch_time = time.perf_counter() - t_epoch
        top1 = validate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} ({epoch_time:.0f}s, "
                  f"{steps_per_epoch * args.batch_size * world_size / epoch_time:.0f} img/s)",
                  flush=True)
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": base_opt.state_dict()},
                       os.path.join(args.ckpt_dir, "checkpoint.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
