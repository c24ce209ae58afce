"""Skin-lesion classification (HAM10000, 7 classes) with a ResNet-34 backbone.

The JAX/flax version folded the process index into the PRNG key
(jax.random.fold_in(key, jax.process_index())) so every host drew different
augmentations; the same is done with the torch seed below.

    torchrun --nproc_per_node=4 16_skin_lesion_holdout.py --images /data/ham10000/by_class
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--images", required=True, help="ImageFolder root, one folder per diagnosis")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/ham10000_r34")
    return p.parse_args()


class BalancedAccuracy:
    """Mean per-class recall (the ISIC 2018 metric)."""

    def __init__(self, n_classes, device):
        self.cm = torch.zeros(n_classes, n_classes, dtype=torch.long, device=device)
        self.n = n_classes

    def reset_state(self):
        self.cm.zero_()

    def update_state(self, y, logits):
        idx = y * self.n + logits.argmax(1)
        self.cm += torch.bincount(idx, minlength=self.n * self.n).view(self.n, self.n)

    def result(self):
        cm = self.cm.clone()
        dist.all_reduce(cm)
        recall = cm.diag().float() / cm.sum(1).clamp(min=1).float()
        return recall.mean().item()


class EarlyStopping:
    def __init__(self, patience):
        self.patience, self.best, self.wait = patience, -1.0, 0

    def step(self, value):
        if value > self.best:
            self.best, self.wait = value, 0
            return False, True
        self.wait += 1
        return self.wait >= self.patience, False


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    norm = transforms.Normalize([0.763, 0.546, 0.570], [0.141, 0.153, 0.170])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.6, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(), transforms.ColorJitter(0.1, 0.1, 0.1, 0.02),
        transforms.RandomRotation(30), transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_full = torchvision.datasets.ImageFolder(args.images, transform=train_tf)
    eval_full = torchvision.datasets.ImageFolder(args.images, transform=eval_tf)
    classes = train_full.classes

    perm = torch.randperm(len(train_full)).tolist()
    n_val = int(len(perm) * args.val_fraction)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    train_ds = Subset(train_full, train_idx)
    val_ds = Subset(eval_full, val_idx[rank::world])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=128, num_workers=4, pin_memory=True)

    # inverse-frequency class weights, the Keras class_weight= argument
    targets = np.array(train_full.targets)[train_idx]
    counts = np.bincount(targets, minlength=len(classes)).astype(np.float32)
    class_weight = torch.tensor(counts.sum() / (len(classes) * counts.clip(min=1)), device=device)

    backbone = torchvision.models.resnet34(weights="IMAGENET1K_V1")
    backbone.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(backbone.fc.in_features, len(classes)))
    model = DDP(backbone.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    bal_acc = BalancedAccuracy(len(classes), device)
    early = EarlyStopping(args.patience)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"classes={classes} train={len(train_ds)} val={n_val} replicas={world}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=class_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        bal_acc.reset_state()
        vl = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                vl += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                                   torch.tensor(float(y.numel()), device=device)])
                bal_acc.update_state(y, logits)
        dist.all_reduce(tl)
        dist.all_reduce(vl)
        val_bacc = bal_acc.result()
        stop, improved = early.step(val_bacc)

        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} loss={(tl[0] / tl[1]).item():.4f} "
                  f"val_loss={(vl[0] / vl[1]).item():.4f} val_balanced_acc={val_bacc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if improved:
                torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        if stop:
            if rank == 0:
                print(f"Early stopping; best val_balanced_acc={early.best:.4f}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
