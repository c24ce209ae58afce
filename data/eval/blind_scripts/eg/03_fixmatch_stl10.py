#!/usr/bin/env python
# FixMatch on STL-10 (5k labelled train split + 100k unlabelled split).
# Distributed training, one process per GPU.
import argparse
import math
import os
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.cuda.amp import GradScaler, autocast
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

STL_MEAN = (0.4467, 0.4398, 0.4066)
STL_STD = (0.2603, 0.2566, 0.2713)


def parse_args():
    parser = argparse.ArgumentParser(description="FixMatch STL-10")
    parser.add_argument("--config", type=str, default="configs/fixmatch_stl10.yaml")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default="output/fixmatch_stl10")
    parser.add_argument("--resume", type=str, default=None)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    cfg = {
        "data_root": "/data/stl10", "arch": "resnet18", "batch_size": 16, "uratio": 7,
        "lr": 0.03, "momentum": 0.9, "weight_decay": 5e-4, "num_train_iter": 1_000_000,
        "num_eval_iter": 5000, "p_cutoff": 0.95, "ulb_loss_ratio": 1.0, "ema_m": 0.999,
        "num_workers": 6, "seed": 0,
    }
    if args.config and os.path.exists(args.config):
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for k, v in cfg.items():
        setattr(args, k, v)
    return args


def build_model(num_classes=10):
    net = torchvision.models.resnet18(num_classes=num_classes)
    # small-image stem: 96x96 inputs
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return net


class EMA:
    def __init__(self, model, m):
        self.model = deepcopy(model).eval()
        self.m = m
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def step(self, model):
        for e, p in zip(self.model.parameters(), model.parameters()):
            e.mul_(self.m).add_(p.detach(), alpha=1 - self.m)
        for e, b in zip(self.model.buffers(), model.buffers()):
            e.copy_(b)


class WeakStrong:
    def __init__(self):
        base = [transforms.RandomHorizontalFlip(), transforms.RandomCrop(96, padding=12, padding_mode="reflect")]
        self.weak = transforms.Compose(base)
        self.strong = transforms.Compose(base + [transforms.RandAugment(3, 5)])
        self.post = transforms.Compose([transforms.ToTensor(), transforms.Normalize(STL_MEAN, STL_STD),
                                        transforms.RandomErasing(p=1.0, scale=(0.02, 0.15), value=0)])
        self.post_w = transforms.Compose([transforms.ToTensor(), transforms.Normalize(STL_MEAN, STL_STD)])

    def __call__(self, img):
        return self.post_w(self.weak(img)), self.post(self.strong(img))


def get_lr_lambda(total, warmup=0, cycles=7 / 16):
    def fn(it):
        if it < warmup:
            return float(it) / float(max(1, warmup))
        progress = float(it - warmup) / float(max(1, total - warmup))
        return max(0.0, math.cos(math.pi * cycles * progress))
    return fn


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    top1, n, loss = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        top1 += (logits.argmax(1) == y).sum().item()
        n += y.size(0)
    return top1 / n * 100, loss / n


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    seed_everything(args.seed)

    train_tf = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.RandomCrop(96, padding=12, padding_mode="reflect"),
        transforms.ToTensor(),
        transforms.Normalize(STL_MEAN, STL_STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(STL_MEAN, STL_STD)])

    # the STL-10 binaries are downloaded beforehand by scripts/get_stl10.sh
    lb_dset = torchvision.datasets.STL10(args.data_root, split="train", transform=train_tf)
    ulb_dset = torchvision.datasets.STL10(args.data_root, split="unlabeled", transform=WeakStrong())
    test_dset = torchvision.datasets.STL10(args.data_root, split="test", transform=test_tf)

    lb_sampler = DistributedSampler(lb_dset, num_replicas=world_size, rank=rank, shuffle=True)
    ulb_sampler = DistributedSampler(ulb_dset, num_replicas=world_size, rank=rank, shuffle=True)
    lb_loader = DataLoader(lb_dset, batch_size=args.batch_size, sampler=lb_sampler,
                           num_workers=args.num_workers, pin_memory=True, drop_last=True)
    ulb_loader = DataLoader(ulb_dset, batch_size=args.batch_size * args.uratio, sampler=ulb_sampler,
                            num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_dset, batch_size=256, num_workers=4)

    model = build_model().cuda()
    ema = EMA(model, args.ema_m)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank],
                                                      output_device=args.local_rank)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if ("bn" in name or "bias" in name) else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=args.momentum, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, get_lr_lambda(args.num_train_iter))
    scaler = GradScaler(enabled=args.amp)

    it, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        ema.model.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        it, best_acc = ckpt["it"], ckpt["best_acc"]

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world size {world_size}, labelled {len(lb_dset)}, unlabelled {len(ulb_dset)}", flush=True)

    lb_epoch, ulb_epoch = 0, 0
    lb_iter, ulb_iter = iter(lb_loader), iter(ulb_loader)
    tic = time.time()
    model.train()
    while it < args.num_train_iter:
        try:
            x_lb, y_lb = next(lb_iter)
        except StopIteration:
            lb_epoch += 1
            lb_sampler.set_epoch(lb_epoch)
            lb_iter = iter(lb_loader)
            x_lb, y_lb = next(lb_iter)
        try:
            (x_w, x_s), _ = next(ulb_iter)
        except StopIteration:
            ulb_epoch += 1
            ulb_sampler.set_epoch(ulb_epoch)
            ulb_iter = iter(ulb_loader)
            (x_w, x_s), _ = next(ulb_iter)

        n_lb = x_lb.size(0)
        x = torch.cat([x_lb, x_w, x_s]).to(device, non_blocking=True)
        y_lb = y_lb.to(device, non_blocking=True)
        with autocast(enabled=args.amp):
            logits = model(x)
            logits_lb = logits[:n_lb]
            logits_w, logits_s = logits[n_lb:].chunk(2)
            sup_loss = F.cross_entropy(logits_lb, y_lb)
            with torch.no_grad():
                probs = logits_w.float().softmax(-1)
                conf, pseudo = probs.max(-1)
                mask = (conf >= args.p_cutoff).float()
            unsup_loss = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
            loss = sup_loss + args.ulb_loss_ratio * unsup_loss

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        ema.step(model.module)
        it += 1

        if it % 50 == 0 and rank == 0:
            print(f"[{it}/{args.num_train_iter}] sup {sup_loss.item():.4f} unsup {unsup_loss.item():.4f} "
                  f"mask {mask.mean().item():.3f} lr {scheduler.get_last_lr()[0]:.5f} "
                  f"{(time.time() - tic) / 50:.3f}s/it", flush=True)
            tic = time.time()

        if it % args.num_eval_iter == 0:
            if rank == 0:
                acc, test_loss = test(ema.model, test_loader, device)
                if acc > best_acc:
                    best_acc = acc
                    torch.save(ema.model.state_dict(), os.path.join(args.output_dir, "best_ema.pth"))
                torch.save({"model": model.module.state_dict(), "ema": ema.model.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "it": it, "best_acc": best_acc},
                           os.path.join(args.output_dir, "latest.pth"))
                print(f"eval @ {it}: top1 {acc:.2f} (best {best_acc:.2f}) loss {test_loss:.4f}", flush=True)
            dist.barrier()
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
