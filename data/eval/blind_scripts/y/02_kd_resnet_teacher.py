"""Knowledge distillation: frozen ResNet-101 teacher -> ResNet-18 student (DDP).

The teacher was fine-tuned on the same label set with train_teacher.py; its
checkpoint holds {"model": state_dict, "epoch": ..., "acc1": ...}.

torchrun --nproc_per_node=4 kd_resnet.py --data /datasets/inat-mini --teacher-ckpt runs/teacher_r101/best.pth
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    parser = argparse.ArgumentParser("KD ResNet")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--teacher-ckpt", type=str, required=True)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--wd", type=float, default=5e-5)
    parser.add_argument("--temperature", type=float, default=4.0)
    parser.add_argument("--alpha", type=float, default=0.9, help="weight of the KD term")
    parser.add_argument("--output", type=str, default="runs/kd_r18")
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


def build_loaders(args):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # plain strided split of the val set (no padding duplicates)
    val_shard = Subset(val_set, range(dist.get_rank(), len(val_set), dist.get_world_size()))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def build_teacher(args, device):
    teacher = torchvision.models.resnet101(num_classes=args.num_classes)
    ckpt = torch.load(args.teacher_ckpt)
    state = {k.replace("module.", "", 1): v for k, v in ckpt["model"].items()}
    teacher.load_state_dict(state)
    teacher.to(device)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def kd_loss(student_logits, teacher_logits, targets, T, alpha):
    soft = F.kl_div(
        F.log_softmax(student_logits / T, dim=1),
        F.softmax(teacher_logits / T, dim=1),
        reduction="batchmean",
    ) * (T * T)
    hard = F.cross_entropy(student_logits, targets)
    return alpha * soft + (1.0 - alpha) * hard


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(images)
        correct += (logits.argmax(1) == targets).sum()
        total += targets.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    model.train()
    return (correct / total).item() * 100.0


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = build_loaders(args)
    teacher = build_teacher(args, device)

    student = torchvision.models.resnet18(num_classes=args.num_classes)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[local_rank])

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        student.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        n_t = sum(p.numel() for p in teacher.parameters()) / 1e6
        n_s = sum(p.numel() for p in student.parameters()) / 1e6
        print(f"world {world_size} | teacher {n_t:.1f}M params | student {n_s:.1f}M params")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        running = torch.zeros(2, device=device)
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                with torch.no_grad():
                    t_logits = teacher(images)
                s_logits = student(images)
                loss = kd_loss(s_logits.float(), t_logits.float(), targets, args.temperature, args.alpha)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1
            if it % 100 == 0:
                stats = running.clone()
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"ep {epoch} it {it}/{steps_per_epoch} loss {(stats[0] / stats[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.4f} {time.time() - t0:.0f}s")

        acc = evaluate(student.module, val_loader, device)
        if rank == 0:
            is_best = acc > best_acc
            best_acc = max(acc, best_acc)
            print(f"epoch {epoch} student acc1 {acc:.2f} (best {best_acc:.2f})")
            state = {
                "model": student.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
            }
            torch.save(state, os.path.join(args.output, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
