"""
Fine-tune a torchvision ResNet-50 on a folder of flower photos (ImageFolder layout:
flowers/<class>/*.jpg) on all GPUs of one machine.

    python 07_flowers_finetune.py --root flowers --gpus 4 --epochs 15
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="flowers")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bs", type=int, default=32, help="images per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="head lr for a total batch of 128")
    ap.add_argument("--val-frac", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="out_flowers")
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class TransformSubset(Dataset):
    """random_split returns Subsets sharing one transform; wrap to give each split its own."""

    def __init__(self, subset, transform):
        self.subset, self.transform = subset, transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, y = self.subset[i]
        return self.transform(img), y


def build_model(num_classes):
    m = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    m.fc = nn.Linear(m.fc.in_features, num_classes)
    return m


def reduce_tensor(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            s[0] += F.cross_entropy(out, y, reduction="sum")
            s[1] += (out.argmax(1) == y).sum()
            s[2] += y.size(0)
    s = reduce_tensor(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def train(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29533"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    set_seed(args.seed + rank)  # different augmentation stream on each GPU

    full = datasets.ImageFolder(args.root)
    classes = full.classes
    n_val = int(len(full) * args.val_frac)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(), transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224),
        transforms.ToTensor(), transforms.Normalize(mean, std),
    ])
    train_ds = TransformSubset(train_sub, train_tf)
    val_ds = TransformSubset(val_sub, val_tf)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs * 2, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = build_model(len(classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    scale = args.bs * world_size / 128
    head_params = list(model.module.fc.parameters())
    head_ids = {id(p) for p in head_params}
    backbone_params = [p for p in model.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.AdamW([
        {"params": backbone_params, "lr": args.lr * scale * 0.1},
        {"params": head_params, "lr": args.lr * scale},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "classes.json"), "w") as f:
            json.dump(classes, f)
        print(f"{len(classes)} classes | train {len(train_ds)} | val {len(val_ds)}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run[0] += loss.detach() * y.size(0)
            run[1] += y.size(0)
        scheduler.step()
        run = reduce_tensor(run)
        val_loss, val_acc = evaluate(model, val_loader, device)

        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} train_loss {(run[0] / run[1]).item():.4f} "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.4f} [{time.time() - t0:.0f}s]")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_resnet50.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best val acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    # warm the torchvision weight cache before spawning so workers don't all download it
    models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    mp.spawn(train, args=(args.gpus, args), nprocs=args.gpus, join=True)
