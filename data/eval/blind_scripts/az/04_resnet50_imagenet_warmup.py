"""ResNet-50 on ImageNet-1k, warmup + cosine, AMP.

Re-implementation of our Keras/TPU recipe (tf.keras.applications.ResNet50 +
WarmupCosine schedule) on PyTorch DDP.

    torchrun --nproc_per_node=8 04_resnet50_imagenet_warmup.py --data /datasets/imagenet --batch-size 256
"""
import argparse
import math
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


def parse():
    p = argparse.ArgumentParser(description="ResNet-50 ImageNet")
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=256, help="images per GPU")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--ckpt-dir", default="ckpt/r50")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args()


def warmup_cosine(total_steps, warmup_steps):
    def fn(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return fn


class SparseTopKAccuracy:
    def __init__(self, k, device):
        self.k = k
        self.buf = torch.zeros(2, dtype=torch.float64, device=device)

    def reset_state(self):
        self.buf.zero_()

    def update_state(self, logits, y):
        topk = logits.topk(self.k, dim=1).indices
        self.buf[0] += (topk == y[:, None]).any(dim=1).sum()
        self.buf[1] += y.numel()

    def result(self):
        b = self.buf.clone()
        dist.all_reduce(b)
        return (b[0] / b[1]).item()


def build_loaders(args, rank, world_size):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world_size))),
                            batch_size=200, num_workers=args.workers, pin_memory=True)
    return train_ds, train_loader, train_sampler, val_loader


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, best_top1):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "best_top1": best_top1}, tmp)
    os.replace(tmp, path)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds, train_loader, train_sampler, val_loader = build_loaders(args, rank, world_size)

    model = torchvision.models.resnet50(weights=None).to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])

    # BN / bias excluded from weight decay, as in the Keras recipe
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=args.momentum, nesterov=True)
    steps_per_epoch = len(train_ds) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, args.warmup_epochs * steps_per_epoch))
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    start_epoch, best_top1 = 0, 0.0
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}")

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world_size={world_size} per_gpu_batch={args.batch_size} "
              f"global_batch={args.batch_size * world_size} steps/epoch={steps_per_epoch}")

    top1, top5 = SparseTopKAccuracy(1, device), SparseTopKAccuracy(5, device)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % args.log_every == 0:
                print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f} {(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        model.eval()
        top1.reset_state(); top5.reset_state()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for x, y in val_loader:
                x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
                y = y.to(device, non_blocking=True)
                logits = model(x)
                top1.update_state(logits, y)
                top5.update_state(logits, y)
        acc1, acc5 = top1.result(), top5.result()

        if rank == 0:
            print(f"epoch {epoch}: val top1 {acc1:.4f} top5 {acc5:.4f} ({time.time() - t0:.0f}s)", flush=True)
            save_checkpoint(last_path, model, optimizer, scheduler, scaler, epoch, max(best_top1, acc1))
            if acc1 > best_top1:
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best_weights.pt"))
        best_top1 = max(best_top1, acc1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
