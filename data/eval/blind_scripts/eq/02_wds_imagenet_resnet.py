#!/usr/bin/env python
# ImageNet-1k classification from WebDataset tar shards (imagenet-train-{000000..001281}.tar).
#
#   torchrun --nproc_per_node=8 02_wds_imagenet_resnet.py \
#       --train_shards "/data/imagenet-wds/imagenet-train-{000000..001281}.tar" \
#       --val_shards "/data/imagenet-wds/imagenet-val-{000000..000049}.tar"
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_TRAIN = 1_281_167
NUM_VAL = 50_000
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def parse_args():
    ap = argparse.ArgumentParser(description="ResNet-50 on WebDataset shards")
    ap.add_argument("--train_shards", required=True)
    ap.add_argument("--val_shards", required=True)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch_size", type=int, default=128, help="per GPU")
    ap.add_argument("--base_lr", type=float, default=0.1, help="lr for a global batch of 256")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--warmup_epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shuffle_buffer", type=int, default=5000)
    ap.add_argument("--output_dir", default="./runs/resnet50_wds")
    ap.add_argument("--resume", default="")
    ap.add_argument("--print_freq", type=int, default=100)
    return ap.parse_args()


def make_train_loader(args):
    tf = T.Compose([
        T.RandomResizedCrop(224),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(MEAN, STD),
    ])
    dataset = (
        wds.WebDataset(args.train_shards, nodesplitter=wds.split_by_node,
                       shardshuffle=True, handler=wds.warn_and_continue)
        .shuffle(args.shuffle_buffer)
        .decode("pil", handler=wds.warn_and_continue)
        .to_tuple("jpg;jpeg;png", "cls")
        .map_tuple(tf, int)
        .batched(args.batch_size, partial=False)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True)
    return loader


def make_val_loader(args):
    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    dataset = (
        wds.WebDataset(args.val_shards, nodesplitter=wds.split_by_node, shardshuffle=False)
        .decode("pil")
        .to_tuple("jpg;jpeg;png", "cls")
        .map_tuple(tf, int)
        .batched(256, partial=True)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=4)


def accuracy(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum() for k in topk]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # top1, top5, n
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        c1, c5 = accuracy(output, target)
        stats += torch.stack([c1, c5, torch.tensor(float(target.numel()), device=device)])
    dist.all_reduce(stats)
    model.train()
    return (100.0 * stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    model = torchvision.models.__dict__[args.arch]()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world_size
    lr = args.base_lr * global_bs / 256
    steps_per_epoch = NUM_TRAIN // global_bs
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    params_bn = [p for n, p in model.named_parameters() if p.ndim <= 1]
    params_w = [p for n, p in model.named_parameters() if p.ndim > 1]
    optimizer = torch.optim.SGD([{"params": params_w, "weight_decay": args.wd},
                                 {"params": params_bn, "weight_decay": 0.0}],
                                lr=lr, momentum=args.momentum, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup_steps if s < warmup_steps
        else 0.5 * (1 + math.cos(math.pi * (s - warmup_steps) / (total_steps - warmup_steps))))
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    start_epoch, best_top1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]

    train_loader = make_train_loader(args)
    val_loader = make_val_loader(args)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"global batch {global_bs}, lr {lr:.3f}, {steps_per_epoch} steps/epoch")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t_epoch = time.time()
        running = torch.zeros(2, device=device)
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                output = model(images)
                loss = criterion(output, target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if i % args.print_freq == 0:
                r = running.clone()
                dist.all_reduce(r)
                if rank == 0:
                    print(f"epoch {epoch} it {i} loss {(r[0] / r[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.4f}")
                running.zero_()

        top1, top5 = validate(model.module, val_loader, device)
        is_best = top1 > best_top1
        best_top1 = max(top1, best_top1)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t_epoch:.0f}s  "
                  f"top1 {top1:.2f} top5 {top5:.2f} best {best_top1:.2f}")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_top1": best_top1, "args": vars(args)}
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
            if is_best:
                torch.save(state, os.path.join(args.output_dir, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
