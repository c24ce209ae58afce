#!/usr/bin/env python3
"""ViT-B/16 fine-tuning on iNaturalist-mini with elastic restarts.

Launched with torchrun --max-restarts; every (re)start resumes from the newest
checkpoint in --output-dir.  A small NCCL health check runs before anything
expensive so that a node with a broken fabric fails fast and the agent can
restart the group.
"""
import argparse
import glob
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger("vit_inat")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/datasets/inat2021_mini")
    p.add_argument("--output-dir", default="/mnt/shared/runs/vit_inat")
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    return p.parse_args()


def health_check(world_size: int) -> None:
    """All-reduce a ones tensor and make sure every rank took part."""
    t = torch.ones(1, device="cuda")
    start = time.time()
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if int(t.item()) != world_size:
        raise RuntimeError(f"health check failed: got {t.item()} expected {world_size}")
    log.info("nccl health check ok in %.2fs", time.time() - start)


def setup_distributed():
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s][rank{rank}] %(message)s",
    )
    health_check(world_size)
    torch.cuda.set_device(local_rank)
    return rank, world_size, local_rank


def build_loaders(args, rank, world_size):
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.08, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train_ds = datasets.ImageFolder(os.path.join(args.data_root, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data_root, "val"), val_tf)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,
                                       shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True,
                              persistent_workers=True, drop_last=True)
    # strided shard: every val image is seen exactly once across ranks
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader, len(train_ds.classes)


def cosine_with_warmup(optimizer, warmup_steps, total_steps):
    def fn(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + torch.cos(torch.tensor(progress * 3.141592653589793)).item())
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def latest_checkpoint(output_dir):
    ckpts = sorted(glob.glob(os.path.join(output_dir, "ckpt_e*.pt")))
    return ckpts[-1] if ckpts else None


def save_checkpoint(args, epoch, model, optimizer, scheduler, scaler, best_acc):
    state = {
        "epoch": epoch,
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "best_acc": best_acc,
        "rng_cpu": torch.get_rng_state(),
    }
    path = os.path.join(args.output_dir, f"ckpt_e{epoch:03d}.pt")
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    ckpts = sorted(glob.glob(os.path.join(args.output_dir, "ckpt_e*.pt")))
    for old in ckpts[:-args.keep_last]:
        os.remove(old)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model.module(images)
        stats[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
        stats[1] += (logits.argmax(1) == targets).sum()
        stats[2] += targets.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.output_dir, exist_ok=True)

    train_loader, train_sampler, val_loader, num_classes = build_loaders(args, rank, world_size)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes,
                              drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p_ in model.named_parameters():
        (no_decay if p_.ndim <= 1 or n.endswith(".bias") else decay).append(p_)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr * world_size * args.batch_size / 512,
    )
    steps_per_epoch = len(train_loader)
    scheduler = cosine_with_warmup(optimizer, args.warmup_epochs * steps_per_epoch,
                                   args.epochs * steps_per_epoch)
    scaler = torch.cuda.amp.GradScaler(enabled=False)  # bf16 does not need scaling
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    start_epoch, best_acc = 0, 0.0
    ckpt_path = latest_checkpoint(args.output_dir)
    if ckpt_path is not None:
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt["best_acc"]
        log.info("resumed from %s (epoch %d)", ckpt_path, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1
            if step % 100 == 0 and rank == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step,
                         steps_per_epoch, loss.item(), scheduler.get_last_lr()[0])

        dist.all_reduce(running)
        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            log.info("epoch %d train_loss %.4f val_loss %.4f val_acc %.4f (%.0fs)", epoch,
                     (running[0] / running[1]).item(), val_loss, val_acc, time.time() - t0)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
            save_checkpoint(args, epoch, model, optimizer, scheduler, scaler, best_acc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
