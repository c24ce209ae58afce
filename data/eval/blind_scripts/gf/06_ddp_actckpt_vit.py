"""
ViT-L/16 ImageNet fine-tuning with DDP on 4 x 16GB V100.
Activations of every transformer block are recomputed in backward to fit batch 64/GPU.

torchrun --nproc_per_node=4 06_ddp_actckpt_vit.py --data /datasets/imagenet --batch-size 64
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class CheckpointedViT(nn.Module):
    """Thin wrapper around a timm ViT that recomputes each block and carries an extra
    distillation head (used only when a teacher is given)."""

    def __init__(self, name, num_classes, drop_path, grad_ckpt=True):
        super().__init__()
        self.vit = timm.create_model(name, pretrained=True, num_classes=num_classes,
                                     drop_path_rate=drop_path)
        self.head_dist = nn.Linear(self.vit.num_features, num_classes)
        self.grad_ckpt = grad_ckpt

    def forward_features(self, x):
        v = self.vit
        x = v.patch_embed(x)
        x = v._pos_embed(x)
        x = v.norm_pre(x)
        for blk in v.blocks:
            if self.grad_ckpt and self.training:
                x = cp.checkpoint(blk, x)
            else:
                x = blk(x)
        return v.norm(x)

    def forward(self, x, with_dist=False):
        feats = self.forward_features(x)
        cls = feats[:, 0]
        logits = self.vit.head(self.vit.head_drop(cls))
        if with_dist:
            return logits, self.head_dist(cls)
        return logits


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="vit_large_patch16_224.augreg_in21k")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--base-lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.2)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--teacher", default=None, help="timm name of a CNN teacher for distillation")
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--output", default="output/vit_l_ft")
    return p.parse_args()


def cosine_lr(epoch_float, args, peak):
    if epoch_float < args.warmup_epochs:
        return peak * epoch_float / args.warmup_epochs
    t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.min_lr + 0.5 * (peak - args.min_lr) * (1 + math.cos(math.pi * t))


def build_loaders(args, rank, world):
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = transforms.Compose([
        transforms.Resize(248, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        correct += (logits.argmax(1) == target).sum()
        total += target.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item() * 100


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    model = CheckpointedViT(args.model, num_classes=1000, drop_path=args.drop_path).to(device)
    teacher = None
    if args.teacher:
        teacher = timm.create_model(args.teacher, pretrained=True).to(device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)

    # head_dist is only touched when a teacher is present
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_loader, val_loader, train_sampler = build_loaders(args, rank, world)
    peak_lr = args.base_lr * args.batch_size * world / 512
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    best = 0.0
    steps_per_epoch = len(train_loader)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, target) in enumerate(train_loader):
            lr = cosine_lr(epoch + it / steps_per_epoch, args, peak_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            images, soft_target = mixup(images, target)
            with torch.autocast("cuda", dtype=torch.float16):
                if teacher is not None:
                    logits, logits_dist = model(images, with_dist=True)
                    with torch.no_grad():
                        t_logits = teacher(images)
                    loss = 0.5 * criterion(logits, soft_target) + \
                        0.5 * F.cross_entropy(logits_dist, t_logits.argmax(1))
                else:
                    logits = model(images)
                    loss = criterion(logits, soft_target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 100 == 0:
                mem = torch.cuda.max_memory_allocated() / 2**30
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.4f} lr {lr:.2e} "
                      f"mem {mem:.1f}G {(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc:.2f}", flush=True)
            os.makedirs(args.output, exist_ok=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "acc": acc}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
