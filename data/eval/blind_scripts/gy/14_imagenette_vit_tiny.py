#!/usr/bin/env python3
"""
ViT-Tiny from scratch on Imagenette (160px), timm model + my own loop.

Home cluster: 2 PCs on a 2.5GbE switch, one card each
  pc-a 10.10.0.1 RTX 4070
  pc-b 10.10.0.2 RTX 3060

  pc-a: torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=10.10.0.1 --master_port=29500 vit_imagenette.py
  pc-b: torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 --master_addr=10.10.0.1 --master_port=29500 vit_imagenette.py
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=os.path.expanduser("~/datasets/imagenette2-160"))
    p.add_argument("--img", type=int, default=160)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="for global batch 256")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--out", default="runs/vit_tiny_imagenette")
    return p.parse_args()


def init_distributed():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return rank, world_size


def loaders(args, rank, world):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img, scale=(0.35, 1)),
        transforms.RandomHorizontalFlip(),
        transforms.RandAugment(num_ops=2, magnitude=9),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.img / 0.875)),
        transforms.CenterCrop(args.img),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    tr = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    va = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    trs = DistributedSampler(tr, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    tl = DataLoader(tr, args.bs, sampler=trs, num_workers=8, pin_memory=True, drop_last=True,
                    persistent_workers=True)
    # every rank scores its own slice of val (no padded duplicates), summed below
    vl = DataLoader(Subset(va, list(range(len(va)))[rank::world]), 256, num_workers=4, pin_memory=True)
    return tl, vl, trs, len(tr.classes)


def lr_at(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    args = parse_args()
    rank, world = init_distributed()
    device = torch.cuda.current_device()
    tl, vl, trs, n_cls = loaders(args, rank, world)

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=n_cls,
                              img_size=args.img, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[device])

    peak_lr = args.lr * args.bs * world / 256
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith((".pos_embed", ".cls_token")) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr, betas=(0.9, 0.999))
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=n_cls)
    train_crit = SoftTargetCrossEntropy()

    total = args.epochs * len(tl)
    warm = args.warmup * len(tl)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"classes={n_cls} world={world} peak_lr={peak_lr:.2e} steps={total}", flush=True)

    step, best = 0, 0.0
    for ep in range(args.epochs):
        trs.set_epoch(ep)
        model.train()
        t0 = time.time()
        acc_loss = torch.zeros(2, device=device)
        for x, y in tl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, warm, peak_lr)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = train_crit(model(x), y_soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            acc_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            step += 1

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in vl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                hits[0] += (model.module(x).argmax(-1) == y).sum()
                hits[1] += y.numel()
        dist.all_reduce(acc_loss)
        dist.all_reduce(hits)
        top1 = (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"ep {ep:3d} loss {(acc_loss[0] / acc_loss[1]).item():.4f} top1 {top1:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": ep}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))

    if rank == 0:
        print(f"best top1 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
