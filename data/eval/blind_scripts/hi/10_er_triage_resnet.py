# ER chest film triage: normal vs. abnormal (ResNet-34), trained on the 2019-2023 PACS export.
# Folder layout (ImageFolder): <data>/{train,val}/{normal,abnormal}/*.png
#
# Run on the 4-GPU workstation in the reading room:
#   torchrun --nproc_per_node=4 10_er_triage_resnet.py --data /srv/pacs_export/triage_png --epochs 30
import argparse
import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_parser():
    parser = argparse.ArgumentParser(description="ER triage classifier")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save_dir", type=str, default="/srv/models/triage")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def print0(*a, **kw):
    if dist.get_rank() == 0:
        print(f"[{datetime.datetime.now():%H:%M:%S}]", *a, **kw)
        sys.stdout.flush()


def make_loaders(args):
    # PNGs are 16-bit grayscale windowed to 8-bit on export; replicate to 3 channels for ImageNet weights
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.Resize(288),
        transforms.RandomCrop(256),
        transforms.RandomRotation(5),
        transforms.ColorJitter(brightness=0.2, contrast=0.2),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.Resize(288),
        transforms.CenterCrop(256),
        transforms.ToTensor(),
        normalize,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    assert train_set.classes == ["abnormal", "normal"], train_set.classes

    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # validation runs on rank 0 over the whole val folder
    val_loader = DataLoader(val_set, batch_size=2 * args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def train_one_epoch(model, loader, criterion, optimizer, device, epoch):
    model.train()
    loss_meter = torch.zeros(2, device=device)
    for i, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_meter[0] += loss.detach() * images.size(0)
        loss_meter[1] += images.size(0)
        if i % 50 == 0:
            print0(f"Epoch [{epoch}] [{i}/{len(loader)}] loss {loss.item():.4f}")
    dist.all_reduce(loss_meter)
    return (loss_meter[0] / loss_meter[1]).item()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    scores, labels = [], []
    for images, target in loader:
        logits = model(images.to(device, non_blocking=True))
        # class 0 = abnormal
        scores.append(torch.softmax(logits, dim=1)[:, 0])
        labels.append((target == 0).float().to(device))
    s = torch.cat(scores).cpu().numpy()
    y = torch.cat(labels).cpu().numpy()
    return roc_auc_score(y, s), float(((s > 0.5) == (y > 0.5)).mean())


def main():
    args = get_parser().parse_args()

    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")

    train_loader, val_loader, train_sampler = make_loaders(args)

    model = models.resnet34(weights=models.ResNet34_Weights.IMAGENET1K_V1)
    model.fc = nn.Linear(model.fc.in_features, 2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    # abnormal films are ~30% of the export
    class_weights = torch.tensor([1.0 / 0.3, 1.0 / 0.7], device=device)
    criterion = nn.CrossEntropyLoss(weight=class_weights / class_weights.sum() * 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if dist.get_rank() == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, train_loader, criterion, optimizer, device, epoch)
        scheduler.step()
        if dist.get_rank() == 0:
            auc, acc = validate(model.module, val_loader, device)
            print0(f"Epoch {epoch}: train_loss {train_loss:.4f} val_auc {auc:.4f} val_acc {acc:.4f}")
            ckpt = {"epoch": epoch, "state_dict": model.module.state_dict(), "auc": auc,
                    "optimizer": optimizer.state_dict(), "classes": ["abnormal", "normal"]}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint.pth.tar"))
            if auc > best_auc:
                best_auc = auc
                torch.save(ckpt, os.path.join(args.save_dir, "model_best.pth.tar"))
        dist.barrier()

    print0(f"best val AUC {best_auc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
