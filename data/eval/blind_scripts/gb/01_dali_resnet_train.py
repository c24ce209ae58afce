"""ImageNet training with a DALI input pipeline and DistributedDataParallel.

Launch with torchrun, one process per GPU.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.models as models
from torch.nn.parallel import DistributedDataParallel as DDP

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy

IMAGENET_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
IMAGENET_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def parse_args():
    p = argparse.ArgumentParser(description="DALI + DDP ImageNet")
    p.add_argument("--data", required=True, help="ImageNet root with train/ and val/")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--crop-size", type=int, default=224)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--dali-threads", type=int, default=4)
    p.add_argument("--dali-cpu", action="store_true")
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--output", default="./checkpoints")
    p.add_argument("--resume", default="")
    return p.parse_args()


@pipeline_def
def imagenet_pipe(data_dir, crop, size, shard_id, num_shards, dali_cpu=False, is_training=True):
    jpegs, labels = fn.readers.file(
        file_root=data_dir,
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=is_training,
        pad_last_batch=True,
        name="Reader",
    )
    dali_device = "cpu" if dali_cpu else "gpu"
    decoder_device = "cpu" if dali_cpu else "mixed"
    if is_training:
        images = fn.decoders.image_random_crop(
            jpegs,
            device=decoder_device,
            output_type=types.RGB,
            random_aspect_ratio=[0.75, 1.333],
            random_area=[0.08, 1.0],
            num_attempts=100,
        )
        images = fn.resize(images, device=dali_device, resize_x=crop, resize_y=crop,
                           interp_type=types.INTERP_TRIANGULAR)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
        images = fn.resize(images, device=dali_device, size=size, mode="not_smaller",
                           interp_type=types.INTERP_TRIANGULAR)
        mirror = False
    images = fn.crop_mirror_normalize(
        images.gpu(),
        dtype=types.FLOAT,
        output_layout="CHW",
        crop=(crop, crop),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        mirror=mirror,
    )
    return images, labels.gpu()


def build_loader(args, split, rank, world_size, is_training):
    pipe = imagenet_pipe(
        batch_size=args.batch_size,
        num_threads=args.dali_threads,
        device_id=0,
        seed=12 + rank,
        data_dir=os.path.join(args.data, split),
        crop=args.crop_size,
        size=args.val_size,
        shard_id=rank,
        num_shards=world_size,
        dali_cpu=args.dali_cpu,
        is_training=is_training,
    )
    pipe.build()
    policy = LastBatchPolicy.DROP if is_training else LastBatchPolicy.PARTIAL
    return DALIClassificationIterator(pipe, reader_name="Reader", last_batch_policy=policy, auto_reset=True)


def adjust_lr(optimizer, base_lr, epoch, step, steps_per_epoch, warmup=5):
    # linear warmup then step decay at 30/60/80
    if epoch < warmup:
        lr = base_lr * float(1 + step + epoch * steps_per_epoch) / (warmup * steps_per_epoch)
    else:
        factor = epoch // 30
        if epoch >= 80:
            factor += 1
        lr = base_lr * (0.1 ** factor)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args, base_lr, rank):
    model.train()
    steps = len(loader)
    t0 = time.time()
    for i, data in enumerate(loader):
        images = data[0]["data"]
        target = data[0]["label"].squeeze(-1).long()
        lr = adjust_lr(optimizer, base_lr, epoch, i, steps)

        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        if i % args.print_freq == 0:
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            reduced /= dist.get_world_size()
            if rank == 0:
                ips = args.batch_size * dist.get_world_size() * (i + 1) / (time.time() - t0)
                print(f"epoch {epoch} [{i}/{steps}] loss {reduced.item():.4f} lr {lr:.4f} img/s {ips:.0f}")


@torch.no_grad()
def validate(model, loader):
    model.eval()
    correct = torch.zeros(1, device="cuda")
    total = torch.zeros(1, device="cuda")
    for data in loader:
        images = data[0]["data"]
        target = data[0]["label"].squeeze(-1).long()
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        correct += (output.argmax(1) == target).sum()
        total += target.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item() * 100.0


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.backends.cudnn.benchmark = True

    model = models.__dict__[args.arch]()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.cuda(local_rank).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    base_lr = args.lr * args.batch_size * world_size / 256.0
    criterion = nn.CrossEntropyLoss().cuda(local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=args.momentum,
                                weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    train_loader = build_loader(args, "train", rank, world_size, is_training=True)
    val_loader = build_loader(args, "val", rank, world_size, is_training=False)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, args, base_lr, rank)
        acc = validate(model, val_loader)
        if rank == 0:
            is_best = acc > best_acc
            best_acc = max(acc, best_acc)
            print(f"epoch {epoch} top1 {acc:.2f} best {best_acc:.2f}")
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "best_acc": best_acc,
            }
            torch.save(state, os.path.join(args.output, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
