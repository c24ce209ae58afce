#!/usr/bin/env python3
# Data-parallel VGG-16-BN on CIFAR-100 with hand-rolled gradient averaging.
# Gradients are flattened into one buffer per dtype and averaged with a single
# all_reduce per step (cheaper than one call per parameter for VGG's 138 tensors).
#
#   torchrun --standalone --nproc_per_node=4 04_allreduce_vgg_cifar100.py --epochs 200
import argparse
import json
import os
import time
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

MEAN = (0.5071, 0.4865, 0.4409)
STD = (0.2673, 0.2564, 0.2762)

CFG_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, cfg, num_classes=100):
        super().__init__()
        layers, c_in = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c_in, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c_in = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(512, num_classes)
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/cifar100")
    ap.add_argument("--out", default="outputs/vgg16_c100")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--bs", type=int, default=64, help="batch per GPU")
    ap.add_argument("--lr", type=float, default=0.05, help="for global batch 256")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--amp", action="store_true")
    return ap.parse_args()


def allreduce_gradients(params, world_size):
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for bucket in by_dtype.values():
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat.div_(world_size)
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)


def sync_params(model):
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def run_eval(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        for img, target in loader:
            img, target = img.cuda(non_blocking=True), target.cuda(non_blocking=True)
            out = model(img)
            top5 = out.topk(5, dim=1).indices
            acc[0] += (top5[:, 0] == target).sum()
            acc[1] += (top5 == target[:, None]).any(dim=1).sum()
            acc[2] += target.size(0)
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    val_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.CIFAR100(args.root, train=True, transform=train_tf, download=False)
    val_set = datasets.CIFAR100(args.root, train=False, transform=val_tf, download=False)

    train_loader = DataLoader(train_set, batch_size=args.bs, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_set), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=200,
                            num_workers=args.workers, pin_memory=True)

    model = VGG(CFG_VGG16).to(device)
    sync_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.bs * world_size / 256
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[60, 120, 160], gamma=0.2)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump({**vars(args), "world_size": world_size, "lr_scaled": lr,
                       "started": datetime.now().isoformat()}, f, indent=2)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        loss_meter = torch.zeros(2, device=device)
        for i, (img, target) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = F.cross_entropy(model(img), target, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            allreduce_gradients(params, world_size)
            scaler.step(optimizer)
            scaler.update()
            loss_meter[0] += loss.detach() * target.size(0)
            loss_meter[1] += target.size(0)
            if is_main and i % 100 == 0:
                print(f"[{epoch:03d}][{i:04d}/{len(train_loader)}] loss {loss.item():.3f}", flush=True)
        scheduler.step()

        # BN running stats drift apart between replicas; average them before eval
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if buf.dtype.is_floating_point:
                    dist.all_reduce(buf)
                    buf.div_(world_size)
        dist.all_reduce(loss_meter)
        top1, top5 = run_eval(model, val_loader, device)
        if is_main:
            train_loss = (loss_meter[0] / loss_meter[1]).item()
            print(f"epoch {epoch} train_loss {train_loss:.4f} top1 {top1 * 100:.2f} top5 {top5 * 100:.2f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f} {time.time() - tic:.0f}s", flush=True)
            ckpt = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "top1": top1}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if is_main:
        print(f"best top1 {best * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
