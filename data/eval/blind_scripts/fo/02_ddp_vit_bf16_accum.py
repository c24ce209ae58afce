"""ViT-B/16 ImageNet training with DDP, bf16 autocast, activation checkpointing
and gradient accumulation.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        02_ddp_vit_bf16_accum.py --data /datasets/imagenet --out /shared/exp/vit_b16
"""
import argparse
import contextlib
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro step")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--base-lr", type=float, default=5e-4, help="lr for a global batch of 512")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--act-ckpt", action="store_true")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class CheckpointedBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        if self.training:
            return checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


def build_loaders(args, world_size, rank):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    # strided shard of the val set: no padding, so every image is counted exactly once
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=128, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
        stats[0] += F.cross_entropy(out.float(), target, reduction="sum")
        stats[1] += (out.argmax(1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0
    torch.backends.cuda.matmul.allow_tf32 = True

    train_loader, train_sampler, val_loader = build_loaders(args, world_size, rank)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=0.1)
    if args.act_ckpt:
        model.blocks = nn.Sequential(*[CheckpointedBlock(b) for b in model.blocks])
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * args.accum * world_size
    lr = args.base_lr * global_batch / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    steps_per_epoch = len(train_loader) // args.accum
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * args.warmup_epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup_steps if s < warmup_steps
        else 0.5 * (1 + math.cos(math.pi * (s - warmup_steps) / (total_steps - warmup_steps))),
    )
    if is_main:
        print(f"world={world_size} global_batch={global_batch} lr={lr:.2e} steps/epoch={steps_per_epoch}")

    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pth")
    resume = args.resume or (ckpt_path if os.path.exists(ckpt_path) else "")
    if resume:
        ckpt = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if is_main:
            print(f"resumed from {resume} at epoch {start_epoch}")

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        usable = steps_per_epoch * args.accum  # drop the incomplete accumulation window
        for i, (images, target) in enumerate(train_loader):
            if i >= usable:
                break
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            with (contextlib.nullcontext() if sync_now else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(images)
                    loss = criterion(out, target)
                (loss / args.accum).backward()
            if not sync_now:
                continue
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
            step = (i + 1) // args.accum
            if is_main and step % 100 == 0:
                print(f"ep {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"gnorm {gnorm.item():.2f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / step:.3f}s/step", flush=True)

        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if is_main:
            print(f"epoch {epoch} val_loss {val_loss:.4f} top1 {val_acc:.2f}", flush=True)
            best_acc = max(best_acc, val_acc)
            os.makedirs(args.out, exist_ok=True)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sched": sched.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
            }
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if val_acc >= best_acc:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
