#!/usr/bin/env python
"""Knowledge distillation on CIFAR-100: ResNet-50 teacher -> ResNet-18 student.

The teacher is a CIFAR-style ResNet-50 fine-tuned beforehand (78.9% top-1).
Run with torchrun, one process per GPU.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def parse_args():
    p = argparse.ArgumentParser(description="CIFAR-100 KD (R50 -> R18)")
    p.add_argument("--data-dir", default="./data")
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--output-dir", default="./runs/kd_r50_r18")
    p.add_argument("--epochs", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.05, help="lr for a global batch of 64")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9, help="weight of the KD term")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--resume", default="")
    p.add_argument("--print-freq", type=int, default=50)
    return p.parse_args()


def cifar_resnet(arch, num_classes=100):
    model = getattr(torchvision.models, arch)(num_classes=num_classes)
    # 32x32 inputs: 3x3 stem and no max-pool
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def kd_loss(student_logits, teacher_logits, targets, temperature, alpha):
    soft = F.kl_div(
        F.log_softmax(student_logits / temperature, dim=1),
        F.softmax(teacher_logits / temperature, dim=1),
        reduction="batchmean",
    ) * (temperature ** 2)
    hard = F.cross_entropy(student_logits, targets)
    return alpha * soft + (1.0 - alpha) * hard, soft.detach(), hard.detach()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(images)
        stats[0] += F.cross_entropy(logits, targets, reduction="sum")
        stats[1] += (logits.argmax(dim=1) == targets).sum()
        stats[2] += targets.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR100_MEAN, CIFAR100_STD),
    ])
    val_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR100_MEAN, CIFAR100_STD)])

    # download once, the other ranks read the extracted files afterwards
    if is_main:
        torchvision.datasets.CIFAR100(args.data_dir, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data_dir, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(args.data_dir, train=True, transform=train_tf)
    val_set = torchvision.datasets.CIFAR100(args.data_dir, train=False, transform=val_tf)
    # each rank scores a disjoint slice of the test set, the sums are reduced
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))

    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    # frozen teacher, plain module on the local GPU (no gradients, no DDP)
    teacher = cifar_resnet("resnet50")
    t_state = torch.load(args.teacher_ckpt, map_location="cpu")
    teacher.load_state_dict(t_state.get("model", t_state))
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = cifar_resnet("resnet18").to(device)
    student = DDP(student, device_ids=[local_rank])

    global_batch = args.batch_size * world_size
    lr = args.lr * global_batch / 64
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=total_steps, pct_start=0.05,
        anneal_strategy="cos", div_factor=25.0, final_div_factor=1e3,
    )

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        student.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt.get("best_acc", 0.0)

    _, teacher_acc = evaluate(teacher, val_loader, device)
    if is_main:
        print(f"teacher top-1: {teacher_acc:.2f}  | global batch {global_batch}, lr {lr:.4f}")

    for epoch in range(start_epoch, args.epochs):
        student.train()
        t0 = time.time()
        running = torch.zeros(3, device=device)
        for step, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)

            with torch.no_grad():
                t_logits = teacher(images)
            s_logits = student(images)
            loss, soft, hard = kd_loss(s_logits, t_logits, targets, args.temperature, args.alpha)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            running += torch.stack([loss.detach(), soft, hard])
            if is_main and step % args.print_freq == 0:
                r = running / (step + 1)
                print(f"ep {epoch} [{step}/{len(train_loader)}] loss {r[0]:.4f} "
                      f"kd {r[1]:.4f} ce {r[2]:.4f} lr {scheduler.get_last_lr()[0]:.5f}")

        val_loss, val_acc = evaluate(student, val_loader, device)
        if is_main:
            print(f"epoch {epoch}: val loss {val_loss:.4f} top-1 {val_acc:.2f} "
                  f"({time.time() - t0:.0f}s)")
            is_best = val_acc > best_acc
            best_acc = max(best_acc, val_acc)
            ckpt = {
                "model": student.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
                "args": vars(args),
            }
            torch.save(ckpt, os.path.join(args.output_dir, "last.pth"))
            if is_best:
                torch.save(student.module.state_dict(), os.path.join(args.output_dir, "best_student.pth"))

    if is_main:
        print(f"done, best student top-1 {best_acc:.2f} (teacher {teacher_acc:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
