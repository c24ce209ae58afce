"""ImageNet ResNet-50 with ZeroRedundancyOptimizer(AdamW).

Part of the optimizer-state sharding experiments: same recipe as the DDP+AdamW
baseline, only the optimizer state is sharded across ranks.

    torchrun --nproc_per_node=8 zero_adamw_resnet.py --data /datasets/imagenet --out runs/zero_r50
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger(__name__)

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def get_args():
    parser = argparse.ArgumentParser(description="ResNet-50 / ZeRO-AdamW")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--base-lr", type=float, default=1e-3, help="LR per 1024 images")
    parser.add_argument("--wd", type=float, default=0.05)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--resume", default="")
    return parser.parse_args()


def build_loaders(args):
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def cosine_with_warmup(warmup_steps, total_steps):
    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * t))
    return lr_lambda


def accuracy(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.view(1, -1))
    return [correct[:k].reshape(-1).float().sum() for k in topk]


@torch.no_grad()
def validate(model, loader, criterion, device):
    model.eval()
    totals = torch.zeros(4, device=device)  # loss_sum, top1, top5, n
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = model(images)
        loss = criterion(output.float(), target)
        top1, top5 = accuracy(output, target)
        totals += torch.stack([loss * images.size(0), top1, top5,
                               torch.tensor(float(images.size(0)), device=device)])
    dist.all_reduce(totals)
    return (totals[0] / totals[3]).item(), (100 * totals[1] / totals[3]).item(), (100 * totals[2] / totals[3]).item()


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_acc1, rank):
    if rank == 0:
        optimizer.consolidate_state_dict(to=0)
        state = {
            "epoch": epoch,
            "arch": "resnet50",
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "best_acc1": best_acc1,
        }
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args)

    model = torchvision.models.__dict__[args.arch]()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world_size / 1024
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=lr,
        betas=(0.9, 0.999),
        weight_decay=args.wd,
    )
    steps_per_epoch = len(train_loader)
    scheduler = LambdaLR(optimizer, cosine_with_warmup(args.warmup_epochs * steps_per_epoch,
                                                       args.epochs * steps_per_epoch))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).to(device)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc1 = ckpt["epoch"] + 1, ckpt["best_acc1"]
        log.info("resumed from epoch %d (best %.2f)", ckpt["epoch"], best_acc1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log.info("world %d, lr %.3e, local opt state shard on every rank", world_size, lr)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                output = model(images)
            loss = criterion(output.float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if i % args.print_freq == 0:
                batch_time = (time.time() - end) / (1 if i == 0 else args.print_freq)
                log.info("epoch %d [%d/%d] loss %.4f lr %.3e %.3fs/it",
                         epoch, i, steps_per_epoch, loss.item(), scheduler.get_last_lr()[0], batch_time)
                end = time.time()

        val_loss, acc1, acc5 = validate(model, val_loader, criterion, device)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        log.info("epoch %d val loss %.4f acc@1 %.2f acc@5 %.2f (best %.2f)", epoch, val_loss, acc1, acc5, best_acc1)

        save_checkpoint(os.path.join(args.out, "checkpoint.pt"), model, optimizer, scheduler, epoch, best_acc1, rank)
        if is_best and rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, "model_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
