"""ViT-S/16 fine-tuning on the plant-disease field photos (38 classes).

#!/bin/bash
#SBATCH -J vit-plant
#SBATCH -N 2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH -c 12
#SBATCH -t 08:00:00
#SBATCH -o slurm-%j.log
nodes=( $(scontrol show hostnames "$SLURM_JOB_NODELIST") )
export MASTER_ADDR=${nodes[0]}
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 40000 ))
srun --cpu-bind=none python vit_plant.py --root /gpfs/data/plantvillage_field \
    --save-dir /gpfs/$USER/vit-plant/$SLURM_JOB_ID
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--model", default="vit_small_patch16_224.augreg_in21k_ft_in1k")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="at global batch 1024")
    p.add_argument("--layer-decay", type=float, default=0.75)
    p.add_argument("--warmup-epochs", type=int, default=2)
    return p.parse_args()


def setup():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://", world_size=world_size, rank=rank)
    return rank, world_size, local_rank


def param_groups_lrd(model, wd, layer_decay):
    n_layers = len(model.blocks) + 1
    scales = [layer_decay ** (n_layers - i) for i in range(n_layers + 1)]
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_wd = p.ndim == 1 or name in ("cls_token", "pos_embed")
        if name.startswith(("cls_token", "pos_embed", "patch_embed")):
            lid = 0
        elif name.startswith("blocks."):
            lid = int(name.split(".")[1]) + 1
        else:
            lid = n_layers
        key = f"l{lid}_{'nowd' if no_wd else 'wd'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else wd, "lr_scale": scales[lid]}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    crit = nn.CrossEntropyLoss(reduction="sum")
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss_sum += crit(out.float(), y).item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.numel()
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return stats[0].item() / stats[1].item(), stats[2].item() / stats[1].item()


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)

    model = timm.create_model(args.model, pretrained=True, num_classes=38, drop_path_rate=0.1)
    cfg = model.pretrained_cfg
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m7-mstd0.5", re_prob=0.25,
                                mean=cfg["mean"], std=cfg["std"])
    val_tf = create_transform(224, is_training=False, mean=cfg["mean"], std=cfg["std"])
    train_set = ImageFolder(os.path.join(args.root, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.root, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=128,
                            num_workers=10, pin_memory=True)

    model = DDP(model.to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world_size / 1024
    opt = torch.optim.AdamW(param_groups_lrd(model.module, 0.05, args.layer_decay), lr=lr)
    iters = len(train_loader)
    total, warm = args.epochs * iters, args.warmup_epochs * iters

    def set_lr(it):
        f = it / warm if it < warm else 0.5 * (1 + math.cos(math.pi * (it - warm) / (total - warm)))
        for g in opt.param_groups:
            g["lr"] = lr * f * g["lr_scale"]

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            set_lr(epoch * iters + i)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{iters} loss {loss.item():.4f}", flush=True)

        acc, vloss = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"== epoch {epoch} val_acc {acc:.4f} val_loss {vloss:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc,
                            "classes": train_set.classes}, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
