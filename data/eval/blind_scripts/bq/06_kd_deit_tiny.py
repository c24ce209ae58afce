"""DeiT-style hard distillation: DeiT-Tiny (distillation token) from a frozen ViT-B/16 teacher
that was fine-tuned in-house on our 1000-class product taxonomy.

    torchrun --nproc_per_node=8 06_kd_deit_tiny.py --data /fsx/products_1k \
        --teacher /fsx/ckpt/vitb16_products/checkpoint_best.pth --out /fsx/ckpt/deit_tiny_kd
"""
import argparse
import logging
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

logger = logging.getLogger("kd")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--teacher", required=True, help="checkpoint of the fine-tuned ViT-B/16 teacher")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--blr", type=float, default=5e-4, help="lr per 512 images")
    ap.add_argument("--min-lr", type=float, default=1e-5)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--drop-path", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--save-freq", type=int, default=10)
    return ap.parse_args()


def cosine_lr(step, total, warmup, base, min_lr):
    if step < warmup:
        return base * step / max(1, warmup)
    p = (step - warmup) / max(1, total - warmup)
    return min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * p))


def hard_distillation_loss(outputs, teacher_logits, targets, base_criterion):
    cls_out, dist_out = outputs
    base = base_criterion(cls_out, targets)
    teacher_labels = teacher_logits.argmax(dim=1)
    distill = F.cross_entropy(dist_out, teacher_labels)
    return 0.5 * base + 0.5 * distill


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)  # eval mode: mean of cls and distillation heads
        s[0] += (out.argmax(-1) == target).sum()
        s[1] += (out.topk(5, -1).indices == target[:, None]).any(-1).sum()
        s[2] += target.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    # ---- models
    teacher = timm.create_model("vit_base_patch16_224", num_classes=args.num_classes)
    teacher_ckpt = torch.load(args.teacher)
    teacher.load_state_dict(teacher_ckpt["model"])
    del teacher_ckpt
    teacher = teacher.to(device).eval().requires_grad_(False)

    student = timm.create_model("deit_tiny_distilled_patch16_224", num_classes=args.num_classes,
                                drop_path_rate=args.drop_path)
    student.to(device)
    data_cfg = resolve_data_config({}, model=student)
    student = DDP(student, device_ids=[local_rank])

    # ---- data
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic",
                                mean=data_cfg["mean"], std=data_cfg["std"])
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875,
                              mean=data_cfg["mean"], std=data_cfg["std"])
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256,
                        num_workers=args.workers, pin_memory=True)

    lr = args.blr * args.batch_size * world / 512
    no_wd = {"pos_embed", "cls_token", "dist_token"}
    params = [
        {"params": [p for n, p in student.module.named_parameters() if p.ndim > 1 and n not in no_wd],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in student.module.named_parameters() if p.ndim <= 1 or n in no_wd],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999))
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)

    start_epoch = 0
    last_path = os.path.join(args.out, "last.pth")
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location="cpu")
        student.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"] + 1
        logger.info("resumed at epoch %d", start_epoch)

    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch
    warm = args.warmup_epochs * steps_per_epoch
    logger.info("world=%d global batch=%d lr=%.2e", world, args.batch_size * world, lr)

    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_dl):
            step = epoch * steps_per_epoch + i
            cur_lr = cosine_lr(step, total, warm, lr, args.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_logits = teacher(images)
                outputs = student(images)
                loss = hard_distillation_loss(outputs, t_logits.float(), target, criterion)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 5.0)
            optimizer.step()
            if i % 100 == 0:
                logger.info("ep %d it %d/%d loss %.4f lr %.2e", epoch, i, steps_per_epoch, loss.item(), cur_lr)

        top1, top5 = evaluate(student, val_dl, device)
        logger.info("epoch %d (%.0fs): top1 %.2f top5 %.2f", epoch, time.time() - t0, top1, top5)
        if rank == 0:
            ck = {"model": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "epoch": epoch, "top1": top1}
            torch.save(ck, last_path)
            if (epoch + 1) % args.save_freq == 0:
                torch.save(ck, os.path.join(args.out, f"epoch_{epoch:03d}.pth"))
            if top1 > best:
                best = top1
                torch.save(student.module.state_dict(), os.path.join(args.out, "best_student.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
