#!/usr/bin/env python
"""Knowledge distillation: Swin-B teacher -> Swin-T student on ImageNet-1k.

Originally a single-node mp.spawn script, now run across nodes through srun:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=12
    #SBATCH --time=3-00:00:00

    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=29555
    srun python swin_distill.py --imagenet /datasets/imagenet --teacher /models/swin_base_in1k.pth \
         --out /projects/kd/swin_t_kd
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--imagenet", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="for global batch 1024")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the KD term")
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--warmup-epochs", type=int, default=20)
    return p.parse_args()


def init_distributed():
    world_size = int(os.environ.get("WORLD_SIZE", torch.cuda.device_count()))
    rank = int(os.environ.get("RANK", os.environ["SLURM_PROCID"]))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["SLURM_LOCALID"]))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank)
    return rank, world_size, local_rank


def kd_loss(student_logits, teacher_logits, soft_targets, alpha, tau):
    ce = torch.sum(-soft_targets * F.log_softmax(student_logits, dim=-1), dim=-1).mean()
    kd = F.kl_div(F.log_softmax(student_logits / tau, dim=-1),
                  F.log_softmax(teacher_logits / tau, dim=-1),
                  reduction="batchmean", log_target=True) * tau * tau
    return (1 - alpha) * ce + alpha * kd


def main():
    args = parse_args()
    rank, world_size, local_rank = init_distributed()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42 + rank)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_ds = ImageFolder(os.path.join(args.imagenet, "train"), train_tf)
    val_ds = ImageFolder(os.path.join(args.imagenet, "val"), val_tf)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    nw = int(os.environ.get("SLURM_CPUS_PER_TASK", 10))
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=nw,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), 200,
                        num_workers=nw, pin_memory=True)

    teacher = timm.create_model("swin_base_patch4_window7_224", num_classes=1000)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher = teacher.to(device).eval().requires_grad_(False)

    student = timm.create_model("swin_tiny_patch4_window7_224", num_classes=1000,
                                drop_path_rate=0.2).to(device)
    student = DDP(student, device_ids=[local_rank])

    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 1024
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.05)
    spe = len(train_dl)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, 0.001, 1.0, args.warmup_epochs * spe),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, (args.epochs - args.warmup_epochs) * spe,
                                                    eta_min=1e-5)],
        milestones=[args.warmup_epochs * spe])
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)

    ckpt = os.path.join(args.out, "student_last.pth")
    start = 0
    if os.path.isfile(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        student.module.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        start = st["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} global batch={global_bs} lr={lr:.2e}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
            loss = kd_loss(s_logits.float(), t_logits.float(), y_soft, args.alpha, args.tau)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(student.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{spe}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        student.eval()
        res = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                res[0] += (student.module(x).argmax(-1) == y).sum()
                res[1] += y.numel()
        dist.all_reduce(res)
        if rank == 0:
            print(f"epoch {epoch} student top1 {100 * res[0].item() / res[1].item():.2f}", flush=True)
            torch.save({"model": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
