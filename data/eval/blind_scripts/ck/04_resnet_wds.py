"""ResNet-50 'A2'-style recipe (LAMB + BCE) streaming ImageNet from webdataset shards.

Shards: imagenet-train-{000000..001281}.tar, each sample has .jpg and .cls
"""
import argparse
import logging
import math
import multiprocessing as mp
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform, resolve_data_config
from timm.loss import BinaryCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, accuracy

_logger = logging.getLogger("train")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", default="/mnt/shared/imagenet-wds/imagenet-train-{000000..001281}.tar")
    p.add_argument("--train-samples", type=int, default=1281167)
    p.add_argument("--val-dir", default="/mnt/shared/imagenet/val")
    p.add_argument("--output", default="/mnt/shared/runs/r50_a2")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256, help="per-GPU")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=5e-3, help="for a global batch of 2048")
    p.add_argument("--weight-decay", type=float, default=0.02)
    p.add_argument("--smoothing", type=float, default=0.0)
    p.add_argument("--mixup", type=float, default=0.1)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--drop-path", type=float, default=0.05)
    p.add_argument("--ema-decay", type=float, default=0.9998)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class SharedEpoch:
    def __init__(self, epoch=0):
        self.v = mp.Value("i", epoch)

    def set(self, epoch):
        self.v.value = epoch

    def get(self):
        return self.v.value


class ShuffleShards(wds.PipelineStage):
    """Shuffle the shard list with a seed that depends only on the epoch."""

    def __init__(self, seed, epoch):
        self.seed = seed
        self.epoch = epoch

    def run(self, src):
        urls = list(src)
        random.Random(self.seed + self.epoch.get()).shuffle(urls)
        yield from urls


def make_train_loader(args, transform, shared_epoch, world_size):
    global_batch = args.batch_size * world_size
    steps_per_epoch = args.train_samples // global_batch
    worker_batches = math.ceil(steps_per_epoch / args.workers)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(args.train_shards),
        ShuffleShards(args.seed, shared_epoch),
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(5000, initial=1000),
        wds.decode("pil", handler=wds.warn_and_continue),
        wds.to_tuple("jpg;jpeg;png", "cls"),
        wds.map_tuple(transform, int),
        wds.batched(args.batch_size, partial=False),
    ).repeat().with_epoch(worker_batches)
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=True, pin_memory=True)
    return loader, worker_batches * args.workers


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    for x, y in loader:
        x = x.cuda(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        y = y.cuda(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        a1, a5 = accuracy(out, y, topk=(1, 5))
        t += torch.stack([a1 * x.size(0) / 100, a5 * x.size(0) / 100,
                          torch.tensor(float(x.size(0)), device=device)])
    dist.all_reduce(t)
    return 100 * t[0].item() / t[2].item(), 100 * t[1].item() / t[2].item()


def main():
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    if rank != 0:
        _logger.setLevel(logging.WARNING)
    torch.manual_seed(args.seed + rank)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    data_cfg = resolve_data_config({}, model=model)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    ddp_model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model, decay=args.ema_decay)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m7-mstd0.5-inc1",
                                interpolation="bicubic", mean=data_cfg["mean"], std=data_cfg["std"])
    val_tf = create_transform(224, is_training=False, crop_pct=0.95, interpolation="bicubic",
                              mean=data_cfg["mean"], std=data_cfg["std"])
    shared_epoch = SharedEpoch()
    train_loader, steps_per_epoch = make_train_loader(args, train_tf, shared_epoch, world_size)
    val_set = datasets.ImageFolder(args.val_dir, val_tf)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=256,
                            num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * world_size / 2048
    optimizer = create_optimizer_v2(model, opt="lamb", lr=lr, weight_decay=args.weight_decay)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=1e-6,
                                  warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-6,
                                  t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                  num_classes=1000)
    criterion = BinaryCrossEntropy(target_threshold=0.2).to(device)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    _logger.info(f"world={world_size} global batch={args.batch_size * world_size} lr={lr:.2e} "
                 f"steps/epoch={steps_per_epoch}")

    best = 0.0
    num_updates = 0
    for epoch in range(args.epochs):
        shared_epoch.set(epoch)
        ddp_model.train()
        tic = time.time()
        for step, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            images, target = mixup(images, target)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp_model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            ema.update(model)
            num_updates += 1
            scheduler.step_update(num_updates=num_updates)
            if step % 100 == 0:
                _logger.info(f"epoch {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f} "
                             f"lr {optimizer.param_groups[0]['lr']:.2e} "
                             f"{(step + 1) * args.batch_size * world_size / (time.time() - tic):.0f} img/s")

        top1, top5 = validate(model, val_loader, device)
        ema_top1, _ = validate(ema.module, val_loader, device)
        _logger.info(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ema top1 {ema_top1:.2f}")
        if rank == 0:
            state = {"epoch": epoch, "model": model.state_dict(), "ema": ema.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
            torch.save(state, os.path.join(args.output, "last.pth.tar"))
            if ema_top1 > best:
                best = ema_top1
                torch.save(ema.module.state_dict(), os.path.join(args.output, "model_best_ema.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
