"""Lion on Tiny-ImageNet with an optional rotation-prediction auxiliary loss.

The aux head is part of the ablation grid (aux_weight in {0, 0.1, 0.5}); the
default run is the plain classifier.

    torchrun --nproc_per_node=4 lion_aux.py --data /data/tiny-imagenet-200 --lr 3e-4 --wd 0.5
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lion_pytorch import Lion
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class ClassifierWithAux(nn.Module):
    def __init__(self, backbone="resnet26d", num_classes=200):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=False, num_classes=0)
        dim = self.backbone.num_features
        self.head = nn.Linear(dim, num_classes)
        self.rot_head = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(inplace=True), nn.Linear(256, 4))

    def forward(self, x, with_aux=False):
        feats = self.backbone(x)
        logits = self.head(feats)
        if with_aux:
            return logits, self.rot_head(feats)
        return logits


def rotate_batch(x):
    """Rotate every image by a random multiple of 90 degrees; returns images and rotation labels."""
    k = torch.randint(0, 4, (x.size(0),), device=x.device)
    out = torch.stack([torch.rot90(img, int(r), dims=(1, 2)) for img, r in zip(x, k)])
    return out, k


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/lion_aux")
    ap.add_argument("--backbone", default="resnet26d")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4, help="for the global batch (4 x 128)")
    ap.add_argument("--wd", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--aux-weight", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def build_data(args):
    mean, std = (0.480, 0.448, 0.398), (0.277, 0.269, 0.282)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader, val_loader, train_sampler = build_data(args)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(ClassifierWithAux(args.backbone)).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = Lion(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.99))
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"backbone={args.backbone} aux_weight={args.aux_weight} world={world}", flush=True)

    use_aux = args.aux_weight > 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if use_aux:
                x_rot, rot = rotate_batch(x)
                logits, rot_logits = model(torch.cat([x, x_rot]), with_aux=True)
                cls_loss = F.cross_entropy(logits[: x.size(0)], y)
                aux_loss = F.cross_entropy(rot_logits[x.size(0):], rot)
                loss = cls_loss + args.aux_weight * aux_loss
            else:
                logits = model(x)
                cls_loss = F.cross_entropy(logits, y)
                aux_loss = torch.zeros((), device=device)
                loss = cls_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            sched.step()
            meter += torch.stack([cls_loss.detach(), aux_loss.detach(), torch.ones((), device=device)])

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                acc[0] += (model(x).argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} cls {meter[0].item() / meter[2].item():.4f} "
                  f"aux {meter[1].item() / meter[2].item():.4f} top1 {100 * acc[0].item() / acc[1].item():.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "args": vars(args)}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
