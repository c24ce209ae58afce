"""Retrain the winning configuration of the PBT search on all GPUs.

``pbt_search.py`` trains one population member per GPU (batch ``batch_size``
on a single device) and writes ``<search_dir>/leaderboard.json``; the entry
with the best validation top-1 holds the final hyper-parameter schedule.  This
script takes that configuration and trains it from scratch with DDP on the
full training set, for the long budget.

    torchrun --nproc_per_node=8 retrain_best.py --search-dir runs/pbt_in100 --epochs 300
"""
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--search-dir", required=True)
    p.add_argument("--data", default="/datasets/imagenet100")
    p.add_argument("--out", default=None)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def load_best(search_dir):
    with open(os.path.join(search_dir, "leaderboard.json")) as f:
        board = json.load(f)
    best = max(board["members"], key=lambda m: m["val_top1"])
    return best


def cosine_with_warmup(step, warmup, total, min_ratio=0.01):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        top5 = out.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == y).sum()
        stats[1] += (top5 == y[:, None]).any(dim=1).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out = args.out or os.path.join(args.search_dir, "retrain")

    best = load_best(args.search_dir)
    hp = best["hparams"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        print(f"retraining member {best['member']} (val top1 {best['val_top1']:.4f}): {hp}")
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"source": best, "epochs": args.epochs, "world_size": world}, f, indent=2)
    writer = SummaryWriter(os.path.join(out, "tb")) if rank == 0 else None

    train_tf = create_transform(224, is_training=True, auto_augment=hp.get("auto_augment", "rand-m9-mstd0.5"),
                                re_prob=hp.get("reprob", 0.25))
    val_tf = create_transform(224, is_training=False)
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False)

    batch_size = hp["batch_size"]
    train_loader = DataLoader(train_ds, batch_size=batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(hp.get("arch", "vit_small_patch16_224"), num_classes=len(train_ds.classes),
                              drop_path_rate=hp["drop_path"])
    model = DDP(model.to(device), device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".pos_embed") or "cls_token" in n else decay).append(p)
    optimizer = torch.optim.AdamW([
        {"params": decay, "weight_decay": hp["weight_decay"]},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=hp["lr"], betas=(0.9, 0.999))

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = hp["warmup_epochs"] * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, warmup_steps, total_steps))

    mixup_fn = Mixup(mixup_alpha=hp.get("mixup", 0.8), cutmix_alpha=hp.get("cutmix", 1.0),
                     label_smoothing=hp.get("smoothing", 0.1), num_classes=len(train_ds.classes))
    criterion = SoftTargetCrossEntropy()

    start_epoch, best_top1 = 0, 0.0
    ckpt_path = os.path.join(out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup_fn(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), hp.get("clip_grad", 1.0))
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        dist.all_reduce(running)
        top1, top5 = evaluate(model, val_loader, device)
        if rank == 0:
            train_loss = (running[0] / running[1]).item()
            lr_now = optimizer.param_groups[0]["lr"]
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("train/lr", lr_now, epoch)
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            print(f"epoch {epoch:3d} loss {train_loss:.4f} top1 {top1:.4f} top5 {top5:.4f} "
                  f"lr {lr_now:.2e} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "best_top1": max(best_top1, top1), "hparams": hp}
            torch.save(state, ckpt_path)
            if top1 > best_top1:
                torch.save(state, os.path.join(out, "best.pt"))
        best_top1 = max(best_top1, top1)

    if rank == 0:
        writer.close()
        print(f"done, best top1 {best_top1:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
