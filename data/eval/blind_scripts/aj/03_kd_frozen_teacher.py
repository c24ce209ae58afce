"""Knowledge distillation on ImageNet: frozen ResNet-152 teacher -> ResNet-18 student.

Hinton-style KD (soft targets at temperature T) mixed with the hard-label CE.
Launch:
    torchrun --nproc_per_node=8 03_kd_frozen_teacher.py \
        --data /datasets/imagenet --teacher-ckpt weights/r152_top1_82.3.pth
"""
import argparse
import json
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("kd")


def get_args():
    p = argparse.ArgumentParser("KD")
    p.add_argument("--data", type=str, required=True)
    p.add_argument("--student", type=str, default="resnet18")
    p.add_argument("--teacher", type=str, default="resnet152")
    p.add_argument("--teacher-ckpt", type=str, required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128, help="per-GPU batch size")
    p.add_argument("--lr", type=float, default=0.1, help="for global batch 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9, help="weight of the KD term")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--out", type=str, default="output/kd_r18")
    return p.parse_args()


def kd_loss(student_logits, teacher_logits, target, T, alpha):
    soft = F.kl_div(
        F.log_softmax(student_logits / T, dim=1),
        F.softmax(teacher_logits / T, dim=1),
        reduction="batchmean",
    ) * (T * T)
    hard = F.cross_entropy(student_logits, target)
    return alpha * soft + (1.0 - alpha) * hard


def load_teacher(arch, ckpt_path, num_classes=1000):
    teacher = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    state = torch.load(ckpt_path, map_location="cpu")
    if "state_dict" in state:
        state = state["state_dict"]
    state = {k.replace("module.", "", 1): v for k, v in state.items()}
    teacher.load_state_dict(state)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.to("cuda:0")


def build_data(args):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            norm,
        ]),
    )
    val_set = datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            norm,
        ]),
    )
    return train_set, val_set


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct, seen = 0, 0
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with autocast():
            logits = model(images)
        correct += (logits.argmax(dim=1) == target).sum().item()
        seen += target.size(0)
    return 100.0 * correct / seen


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set, val_set = build_data(args)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    teacher = load_teacher(args.teacher, args.teacher_ckpt)
    student = timm.create_model(args.student, pretrained=False, num_classes=1000)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=args.epochs * len(train_loader),
        pct_start=5 / args.epochs, anneal_strategy="cos", div_factor=25.0)
    scaler = GradScaler(enabled=args.amp)

    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        tic = time.time()
        for it, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with autocast(enabled=args.amp):
                with torch.no_grad():
                    t_logits = teacher(images)
                s_logits = student(images)
                loss = kd_loss(s_logits.float(), t_logits.float(), target,
                               args.temperature, args.alpha)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if it % 200 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f lr %.5f", epoch, it,
                            len(train_loader), loss.item(), scheduler.get_last_lr()[0])

        # evaluation of the student on the full val set, rank 0 only
        if rank == 0:
            top1 = validate(student.module, val_loader, device)
            logger.info("epoch %d top1 %.2f (%.1f min)", epoch, top1, (time.time() - tic) / 60)
            ckpt = {
                "epoch": epoch,
                "state_dict": student.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "top1": top1,
            }
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    logger.info("best top1 %.2f", best_top1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
