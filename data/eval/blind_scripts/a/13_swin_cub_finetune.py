"""Fine-tune Swin-T (ImageNet-1k weights) on CUB-200-2011, with auto-resume.

    torchrun --nproc_per_node=8 finetune_swin.py --data /data/CUB_200_2011/split --output out/swin_cub
If the job is preempted, launch the same command again: it resumes from <output>/last.pth.
"""
import argparse
import glob
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import Swin_T_Weights, swin_t


def get_args():
    p = argparse.ArgumentParser(description="Swin-T CUB fine-tuning")
    p.add_argument("--data", required=True, help="folder with train/ and test/ ImageFolder splits")
    p.add_argument("--output", required=True)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--blr", type=float, default=1e-4, help="base lr for a global batch of 256")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--save-freq", type=int, default=1)
    return p.parse_args()


def adjust_lr(optimizer, epoch_float, args, peak):
    if epoch_float < args.warmup_epochs:
        lr = peak * epoch_float / args.warmup_epochs
    else:
        t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.min_lr + (peak - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def find_last_checkpoint(output):
    last = os.path.join(output, "last.pth")
    if os.path.isfile(last):
        return last
    ckpts = sorted(glob.glob(os.path.join(output, "epoch_*.pth")))
    return ckpts[-1] if ckpts else None


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
        s[0] += (out.argmax(1) == target).sum()
        s[1] += target.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        Swin_T_Weights.IMAGENET1K_V1.get_state_dict(progress=True)  # download once into the hub cache
    dist.barrier()

    weights = Swin_T_Weights.IMAGENET1K_V1
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.35, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(weights.transforms().mean, weights.transforms().std)])
    test_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(weights.transforms().mean, weights.transforms().std)])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    test_ds = datasets.ImageFolder(os.path.join(args.data, "test"), test_tf)
    test_ds = Subset(test_ds, range(rank, len(test_ds), world_size))

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=64, num_workers=args.workers, pin_memory=True)

    model = swin_t(weights=weights)
    model.head = nn.Linear(model.head.in_features, len(train_ds.classes))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.blr * args.batch_size * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch, best_acc = 0, 0.0
    resume_path = find_last_checkpoint(args.output)
    if resume_path is not None:
        checkpoint = torch.load(resume_path)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
        best_acc = checkpoint.get("best_acc", 0.0)
        if rank == 0:
            print(f"resumed from {resume_path} at epoch {start_epoch}")

    steps = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for i, (images, target) in enumerate(train_loader):
            lr = adjust_lr(optimizer, epoch + i / steps, args, peak_lr)
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_meter += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(loss_meter)
        acc = evaluate(model, test_loader, device)
        best_acc = max(best_acc, acc)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.2e} loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"test acc {acc * 100:.2f} (best {best_acc * 100:.2f}) {time.time() - t0:.0f}s", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "best_acc": best_acc, "args": vars(args)}
            tmp = os.path.join(args.output, "last.pth.tmp")
            torch.save(ckpt, tmp)
            os.replace(tmp, os.path.join(args.output, "last.pth"))
            if (epoch + 1) % args.save_freq == 0:
                torch.save(ckpt, os.path.join(args.output, f"epoch_{epoch:03d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
