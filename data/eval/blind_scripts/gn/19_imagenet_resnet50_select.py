"""ResNet-50 on ImageNet-1k with a held-out minival for model selection.

10k images of the train set are held out (fixed list) as minival; the best epoch
by minival top-1 is restored at the end and scored on the official val set.

    torchrun --nnodes=1 --nproc_per_node=8 19_imagenet_resnet50_select.py \
        --data /datasets/imagenet --minival-list splits/minival_10k.txt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--minival-list", required=True, help="relative paths of the held-out train images")
    p.add_argument("--output-dir", default="/checkpoint/r50_minival")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256, scaled linearly")
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--workers", type=int, default=12)
    return p.parse_args()


def build_data(args, rank, world):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize])

    train_root = os.path.join(args.data, "train")
    train_full = torchvision.datasets.ImageFolder(train_root, transform=train_tf)
    eval_full = torchvision.datasets.ImageFolder(train_root, transform=eval_tf)
    with open(args.minival_list) as f:
        held_out = {os.path.join(train_root, line.strip()) for line in f if line.strip()}
    minival_idx = [i for i, (path, _) in enumerate(train_full.samples) if path in held_out]
    train_idx = [i for i, (path, _) in enumerate(train_full.samples) if path not in held_out]
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)

    train_set = Subset(train_full, train_idx)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)

    def eval_loader(ds, idx):
        return DataLoader(Subset(ds, idx[rank::world]), batch_size=250, num_workers=args.workers,
                          pin_memory=True)

    return sampler, train_loader, eval_loader(eval_full, minival_idx), \
        eval_loader(val_set, list(range(len(val_set))))


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        top5 = out.topk(5, 1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(1).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    sampler, train_loader, minival_loader, val_loader = build_data(args, rank, world)

    model = torchvision.models.resnet50()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0}],
                                lr=lr, momentum=0.9, nesterov=True)
    iters = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs * iters)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - args.warmup_epochs) * iters)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine],
                                                      milestones=[args.warmup_epochs * iters])
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_path = os.path.join(args.output_dir, "best.pth")
    last_path = os.path.join(args.output_dir, "last.pth")
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world {world} | global batch {args.batch_size * world} | peak lr {lr:.3f}", flush=True)

    best_top1, epochs_without_gain = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if is_main and i % 200 == 0:
                print(f"[{epoch}][{i}/{iters}] loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.4f}",
                      flush=True)

        top1, top5 = accuracy(model.module, minival_loader, device)
        improved = top1 > best_top1
        if improved:
            best_top1, epochs_without_gain = top1, 0
        else:
            epochs_without_gain += 1
        if is_main:
            print(f"epoch {epoch} minival top1 {top1:.2f} top5 {top5:.2f} best {best_top1:.2f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "minival_top1": top1}
            torch.save(state, last_path)
            if improved:
                torch.save(state, best_path)
        if epochs_without_gain >= args.patience:
            if is_main:
                print(f"no minival gain in {args.patience} epochs, stopping", flush=True)
            break

    best = torch.load(best_path, map_location=device)
    model.module.load_state_dict(best["model"])
    top1, top5 = accuracy(model.module, val_loader, device)
    if is_main:
        print(f"best epoch {best['epoch']} (minival {best['minival_top1']:.2f}) -> "
              f"ImageNet val top1 {top1:.2f} top5 {top5:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
