#!/usr/bin/env python3
"""
Oxford Flowers-102 with timm EfficientNet-B0, trained on the two boxes under my desk.

  node 0: 'ryzen'  192.168.0.111  RTX 3070
  node 1: 'intel'  192.168.0.112  RTX 2060 Super

Each box has its own copy of the dataset (torchvision Flowers102 download in ~/data).
Trains on 'train', picks the best epoch on 'val', then reports 'test'
(6149 images) with the best weights.

  torchrun --nnodes 2 --nproc_per_node 1 --node_rank N --master_addr 192.168.0.111 \
      --master_port 29501 flowers_effnet.py
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=os.path.expanduser("~/data"))
    p.add_argument("--model", default="efficientnet_b0.ra_in1k")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="checkpoints/flowers102")
    return p.parse_args()


def make_loaders(args, rank, world):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.4, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomRotation(15),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    eval_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    train = datasets.Flowers102(args.data, split="train", transform=train_tf, download=False)
    val = datasets.Flowers102(args.data, split="val", transform=eval_tf, download=False)
    test = datasets.Flowers102(args.data, split="test", transform=eval_tf, download=False)

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)

    def shard(ds):
        # contiguous shard per rank, no padding
        per = (len(ds) + world - 1) // world
        return Subset(ds, range(rank * per, min(len(ds), (rank + 1) * per)))

    val_loader = DataLoader(shard(val), batch_size=128, num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(shard(test), batch_size=128, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, test_loader, sampler


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    counts = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = net(x).argmax(1)
        counts[0] += (pred == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader, val_loader, test_loader, sampler = make_loaders(args, rank, world)
    net = timm.create_model(args.model, pretrained=True, num_classes=102, drop_rate=0.3).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        val_acc = evaluate(net, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch + 1:02d} loss {(tot[0] / tot[1]).item():.4f} val acc {val_acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_acc": val_acc}, best_path)
        dist.barrier()

    # final test with the best epoch's weights
    ckpt = torch.load(best_path, map_location=device)
    net.load_state_dict(ckpt["model"])
    test_acc = evaluate(net, test_loader, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch'] + 1}: val {ckpt['val_acc']:.4f} test {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
