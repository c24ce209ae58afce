"""ResNet-50 ImageNet, 90 epochs, tuned recipe (channels_last, bf16, compile, SyncBN, LARS-free SGD).

    torchrun --nproc_per_node=8 11_resnet50_imagenet.py --data /datasets/imagenet --out /shared/r50
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def parse_args():
    p = argparse.ArgumentParser(description="ResNet-50 DDP")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--resume", default="")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def build_loaders(args, rank, world):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(176), T.RandomHorizontalFlip(), T.TrivialAugmentWide(),
                   T.PILToTensor(), T.ConvertImageDtype(torch.float), normalize]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(232), T.CenterCrop(224), T.PILToTensor(), T.ConvertImageDtype(torch.float), normalize]))
    train_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=3)
    val_idx = list(range(rank, len(val), world))
    val_loader = DataLoader(Subset(val, val_idx), batch_size=250, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    correct1 = torch.zeros((), device=device)
    correct5 = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(x)
        top5 = out.topk(5, dim=1).indices
        correct1 += (top5[:, 0] == y).sum()
        correct5 += (top5 == y[:, None]).any(dim=1).sum()
        count += y.numel()
    for t in (correct1, correct5, count):
        dist.all_reduce(t)
    net.train()
    return (correct1 / count).item() * 100, (correct5 / count).item() * 100


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world)

    model = torchvision.models.__dict__[args.arch](weights=None, zero_init_residual=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[args.local_rank], broadcast_buffers=False, gradient_as_bucket_view=True)
    compiled = torch.compile(ddp)

    bn_params = [p for n, p in model.named_parameters() if "bn" in n or "downsample.1" in n]
    other = [p for n, p in model.named_parameters() if not ("bn" in n or "downsample.1" in n)]
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD([{"params": bn_params, "weight_decay": 0.0}, {"params": other, "weight_decay": args.wd}],
                          lr=lr, momentum=args.momentum, nesterov=True, foreach=True)
    iters = len(train_loader)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=args.warmup_epochs * iters)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=(args.epochs - args.warmup_epochs) * iters)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[args.warmup_epochs * iters])
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck.get("best", 0.0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        compiled.train()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for i, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(compiled(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if (i + 1) % args.print_freq == 0:
                stop.record()
                stop.synchronize()
                ms = start.elapsed_time(stop) / args.print_freq
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}][{i + 1}/{iters}] loss {l.item():.3f} lr {sched.get_last_lr()[0]:.4f} "
                          f"{args.batch_size * world / ms * 1000:.0f} img/s", flush=True)
                start.record()

        top1, top5 = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": max(best, top1)}
            torch.save(state, os.path.join(args.out, "checkpoint.pth"))
            if top1 > best:
                torch.save(state, os.path.join(args.out, "model_best.pth"))
        best = max(best, top1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
