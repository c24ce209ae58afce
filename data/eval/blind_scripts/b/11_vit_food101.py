"""Fine-tune torchvision ViT-B/16 on Food-101 with DDP, then evaluate the best checkpoint.

    torchrun --nproc_per_node=4 11_vit_food101.py --data /data/food101 --epochs 10
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import ViT_B_16_Weights, vit_b_16


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/food101")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/vit_food101")
    return p.parse_args()


def build_model(num_classes):
    model = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1)
    model.heads.head = nn.Linear(model.heads.head.in_features, num_classes)
    return model


def build_loaders(args, world_size, rank):
    weights = ViT_B_16_Weights.IMAGENET1K_V1
    mean, std = weights.transforms().mean, weights.transforms().std
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    if rank == 0:
        datasets.Food101(args.data, split="train", download=True)
    dist.barrier()
    train_set = datasets.Food101(args.data, split="train", transform=train_tf)
    test_set = datasets.Food101(args.data, split="test", transform=test_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=64, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)
    return train_loader, test_loader, train_sampler, len(train_set.classes)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        correct += (logits.argmax(-1) == targets).sum()
        seen += targets.numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    return (correct / seen).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out, exist_ok=True)

    train_loader, test_loader, train_sampler, num_classes = build_loaders(args, world_size, rank)

    model = build_model(num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps,
                                                    pct_start=0.1)

    best_acc, best_path = 0.0, os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}/{args.epochs}] it {it}/{len(train_loader)} loss {loss.item():.4f}")

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc * 100:.2f}% time {time.time() - t0:.0f}s")
            if acc > best_acc:
                best_acc = acc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # final evaluation of the best weights with a fresh single-process model
    if rank == 0:
        net = build_model(num_classes)
        net.load_state_dict(torch.load(best_path, map_location="cpu"))
        net.to(device).eval()
        correct = total = 0
        with torch.no_grad():
            for images, targets in DataLoader(test_loader.dataset, batch_size=128,
                                              num_workers=args.workers):
                preds = net(images.to(device)).argmax(-1).cpu()
                correct += (preds == targets).sum().item()
                total += targets.numel()
        result = {"best_acc_during_training": best_acc, "final_test_acc": correct / total}
        print(result)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
