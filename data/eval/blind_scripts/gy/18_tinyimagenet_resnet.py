#!/usr/bin/env python3
"""
Tiny ImageNet (200 classes, 64x64) with a ResNet-18 adapted to small inputs.
Three-box home setup over gigabit ethernet, on gloo (NCCL over this cheap
switch kept stalling for me):

  node0  192.168.1.101  RTX 3080
  node1  192.168.1.102  RTX 2070 Super
  node2  192.168.1.103  GTX 1070

  torchrun --nnodes=3 --nproc_per_node=1 --node_rank=$NODE_RANK \
      --master_addr=192.168.1.101 --master_port=29400 tiny_imagenet.py

val/ was reorganised into class folders with scripts/fix_tin_val.py on every node.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

MEAN = (0.4802, 0.4481, 0.3975)
STD = (0.2770, 0.2691, 0.2821)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=os.path.expanduser("~/data/tiny-imagenet-200"))
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ckpt-dir", default="ckpt_tin")
    return p.parse_args()


def resnet18_small(num_classes=200):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def accuracy(logits, target, topk=(1, 5)):
    _, pred = logits.topk(max(topk), dim=1)
    hit = pred.eq(target[:, None])
    return [hit[:, :k].any(dim=1).sum() for k in topk]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.3, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    val_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.root, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.root, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=500, shuffle=False, num_workers=args.workers)

    model = resnet18_small().to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.bs * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.2)
    start_epoch = 0
    ckpt_file = os.path.join(args.ckpt_dir, "last.pth")
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world {world}, per-rank bs {args.bs}, lr {lr:.3f}, {len(train_loader)} it/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        meter = torch.zeros(3)
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += torch.tensor([loss.item() * y.size(0), (out.argmax(1) == y).sum().item(), y.size(0)])
            if rank == 0 and it % 100 == 0:
                print(f"  ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.3f}", flush=True)
        dist.all_reduce(meter)  # gloo: host tensor is fine
        tr_loss, tr_acc = (meter[0] / meter[2]).item(), (meter[1] / meter[2]).item()

        if rank == 0:
            model.eval()
            top1 = top5 = n = 0
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(device), y.to(device)
                    c1, c5 = accuracy(model.module(x), y)
                    top1 += c1.item()
                    top5 += c5.item()
                    n += y.size(0)
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {tr_loss:.3f} acc {tr_acc:.3f} | "
                  f"val top1 {top1 / n:.4f} top5 {top5 / n:.4f} | {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
