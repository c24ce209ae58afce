"""Fine-tune a pretrained ViT-L/16 (timm) on iNaturalist-2021 mini.
DDP, fp16 autocast with GradScaler, layer-wise lr decay, gradient accumulation.

torchrun --nproc_per_node=8 14_ddp_vit_finetune.py --data /datasets/inat21_mini --out runs/vitl_inat
"""
import argparse
import contextlib
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="vit_large_patch16_224.augreg_in21k")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--layer_decay", type=float, default=0.75)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def param_groups_lrd(model, base_lr, wd, layer_decay):
    num_layers = len(model.blocks) + 1
    scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if n.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer = 0
        elif n.startswith("blocks."):
            layer = int(n.split(".")[1]) + 1
        else:
            layer = num_layers
        decay = p.ndim > 1 and not n.endswith(".bias")
        key = (layer, decay)
        if key not in groups:
            groups[key] = {"params": [], "lr": base_lr * scales[layer], "weight_decay": wd if decay else 0.0}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    crit = nn.CrossEntropyLoss(reduction="sum")
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        loss_sum += crit(logits.float(), labels).item()
        correct += (logits.argmax(1) == labels).sum().item()
        total += labels.numel()
    model.train()
    return loss_sum / total, 100.0 * correct / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = timm.create_model(args.model, pretrained=True, num_classes=10000, drop_path_rate=0.2)
    cfg = resolve_data_config({}, model=model)
    train_set = ImageFolder(os.path.join(args.data, "train"),
                            create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1"))
    val_set = ImageFolder(os.path.join(args.data, "val"), create_transform(**cfg))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)

    model.to(device)
    groups = param_groups_lrd(model, args.lr * args.bs * args.accum * world / 256, args.wd, args.layer_decay)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.999))
    steps_per_epoch = len(train_loader) // args.accum
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_acc = 0.0
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (images, labels) in enumerate(train_loader):
            if i >= steps_per_epoch * args.accum:
                break
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if boundary else model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(images), labels)
                scaler.scale(loss / args.accum).backward()
            if not boundary:
                continue
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if rank == 0 and (i + 1) % (100 * args.accum) == 0:
                print(f"epoch {epoch} step {(i + 1) // args.accum}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"{time.time() - tic:.0f}s", flush=True)

        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.2f}", flush=True)
            history.append({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc})
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
                print(f"new best {best_acc:.2f}", flush=True)
        dist.barrier()

    if rank == 0:
        print(f"best val acc {best_acc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
