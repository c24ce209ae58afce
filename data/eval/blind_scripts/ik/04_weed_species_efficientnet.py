#!/usr/bin/env python3
# Weed species classification from low-altitude drone images (DeepWeeds-style, 9 classes).
# Backbone gets a lower learning rate than the freshly initialised head.
#
#   torchrun --nproc_per_node=4 04_weed_species_efficientnet.py --root /data/weeds --arch tf_efficientnetv2_s
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--arch", default="tf_efficientnetv2_s")
    ap.add_argument("--img-size", type=int, default=320)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backbone-lr-mult", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=0.02)
    ap.add_argument("--mixup", type=float, default=0.2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="checkpoints/weeds")
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


class WeedImages(Dataset):
    def __init__(self, root, split, tf):
        df = pd.read_csv(os.path.join(root, "labels.csv"))
        df = df[df["Split"] == split].reset_index(drop=True)
        self.files = [os.path.join(root, "images", f) for f in df["Filename"]]
        self.labels = df["Label"].astype(int).tolist()
        self.tf = tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return self.tf(img), self.labels[i], i


class WeedNet(nn.Module):
    def __init__(self, arch, num_classes, drop=0.3):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0, global_pool="avg")
        self.head = nn.Sequential(nn.Dropout(drop), nn.Linear(self.backbone.num_features, num_classes))

    def forward(self, x):
        return self.head(self.backbone(x))


def mixup(x, y, alpha, num_classes):
    y1 = F.one_hot(y, num_classes).float()
    if alpha <= 0:
        return x, y1
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], lam * y1 + (1 - lam) * y1[perm]


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    preds, idxs = [], []
    for x, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x.to(device, non_blocking=True))
        preds.append(out.argmax(1))
        idxs.append(idx.to(device))
    preds, idxs = torch.cat(preds), torch.cat(idxs)
    world = dist.get_world_size()
    # every rank has the same number of samples (sampler pads), so plain all_gather works
    g_preds = [torch.empty_like(preds) for _ in range(world)]
    g_idxs = [torch.empty_like(idxs) for _ in range(world)]
    dist.all_gather(g_preds, preds)
    dist.all_gather(g_idxs, idxs)
    preds = torch.cat(g_preds).cpu().numpy()
    idxs = torch.cat(g_idxs).cpu().numpy()
    # drop the duplicated samples the sampler added to even out the shards
    _, first = np.unique(idxs, return_index=True)
    return preds[first], idxs[first]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([
        T.RandomResizedCrop(args.img_size, scale=(0.4, 1.0)),
        T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
        T.RandomApply([T.RandomRotation(180)], p=0.5),
        T.ColorJitter(0.4, 0.4, 0.3, 0.05),
        T.RandomGrayscale(0.05),
        T.ToTensor(), norm,
        T.RandomErasing(p=0.25),
    ])
    val_tf = T.Compose([T.Resize(int(args.img_size * 1.14)), T.CenterCrop(args.img_size), T.ToTensor(), norm])

    train_ds = WeedImages(args.root, "train", train_tf)
    val_ds = WeedImages(args.root, "val", val_tf)
    num_classes = 9
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=args.workers)

    model = WeedNet(args.arch, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    param_groups = [
        {"params": model.backbone.parameters(), "lr": args.lr * args.backbone_lr_mult},
        {"params": model.head.parameters(), "lr": args.lr},
    ]
    optimizer = torch.optim.AdamW(param_groups, weight_decay=args.wd)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[g["lr"] for g in param_groups], total_steps=total_steps, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train / {len(val_ds)} val images, {dist.get_world_size()} GPUs", flush=True)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y, args.mixup, num_classes)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
                loss = torch.sum(-y_soft * F.log_softmax(logits.float(), dim=1), dim=1).mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_acc[0] += loss.detach().float() * x.size(0)
            loss_acc[1] += x.size(0)

        dist.all_reduce(loss_acc)
        preds, idxs = evaluate(model, val_loader, device, len(val_ds))
        if rank == 0:
            labels = np.asarray(val_ds.labels)[idxs]
            acc = float((preds == labels).mean())
            f1 = f1_score(labels, preds, average="macro")
            print(f"ep {epoch:02d} loss {(loss_acc[0] / loss_acc[1]).item():.4f} acc {acc:.4f} macroF1 {f1:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.module.state_dict(), "arch": args.arch, "epoch": epoch, "f1": f1},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
