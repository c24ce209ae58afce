#!/usr/bin/env python
# TSN (ResNet-50, ImageNet init, 3 segments, average consensus) on HMDB-51, RGB stream.
# Frames are pre-extracted to <root>/<class>/<video>/img_00001.jpg.
#
#   torchrun --nproc_per_node=4 19_tsn_hmdb51_rgb.py --root /data/hmdb51/rawframes \
#       --split-dir /data/hmdb51/testTrainMulti_7030_splits --split 1
import argparse
import glob
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    parser = argparse.ArgumentParser(description="TSN RGB on HMDB51")
    parser.add_argument("--root", required=True)
    parser.add_argument("--split-dir", required=True)
    parser.add_argument("--split", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output", default="work_dirs/tsn_r50_hmdb51")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def read_split(split_dir, split, classes):
    train, test = [], []
    for ci, c in enumerate(classes):
        with open(os.path.join(split_dir, f"{c}_test_split{split}.txt")) as f:
            for line in f:
                name, tag = line.split()
                vid = os.path.splitext(name)[0]
                if tag == "1":
                    train.append((c, vid, ci))
                elif tag == "2":
                    test.append((c, vid, ci))
    return train, test


class TSNFrames(Dataset):
    def __init__(self, root, items, segments, train):
        self.root, self.items, self.segments, self.train = root, items, segments, train
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = transforms.Compose([transforms.Resize((256, 340)),
                                          transforms.RandomResizedCrop(224, scale=(0.4, 1.0)),
                                          transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                          transforms.ToTensor(), norm])
        self.num_frames = {}
        for c, v, _ in items:
            self.num_frames[(c, v)] = len(glob.glob(os.path.join(root, c, v, "img_*.jpg")))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        c, v, label = self.items[i]
        n = max(self.num_frames[(c, v)], 1)
        seg_len = n / self.segments
        if self.train:
            idx = [int(seg_len * s + random.random() * seg_len) for s in range(self.segments)]
        else:
            idx = [int(seg_len * (s + 0.5)) for s in range(self.segments)]
        flip = self.train and random.random() < 0.5
        imgs = []
        for j in idx:
            img = Image.open(os.path.join(self.root, c, v, f"img_{min(j, n - 1) + 1:05d}.jpg")).convert("RGB")
            if flip:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            imgs.append(self.tf(img))
        return torch.stack(imgs), label


class TSN(nn.Module):
    def __init__(self, num_classes, dropout=0.8):
        super().__init__()
        base = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        base.fc = nn.Identity()
        self.base = base
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2048, num_classes)
        self.partial_bn = True

    def train(self, mode=True):
        # "partial BN": freeze the statistics of every BN layer except the first one
        super().train(mode)
        if mode and self.partial_bn:
            bns = [m for m in self.base.modules() if isinstance(m, nn.BatchNorm2d)]
            for m in bns[1:]:
                m.eval()
                m.weight.requires_grad_(False)
                m.bias.requires_grad_(False)
        return self

    def forward(self, x):
        b, s = x.shape[:2]
        feats = self.base(x.flatten(0, 1))
        return self.fc(self.drop(feats)).view(b, s, -1).mean(1)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    classes = sorted(d for d in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, d)))
    train_items, test_items = read_split(args.split_dir, args.split, classes)
    train_set = TSNFrames(args.root, train_items, args.segments, train=True)
    test_set = TSNFrames(args.root, test_items, args.segments, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = TSN(len(classes)).cuda()
    model.train()  # sets requires_grad for partial BN before DDP registers the parameters
    model = DistributedDataParallel(model, device_ids=[args.local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 40], gamma=0.1)
    criterion = nn.CrossEntropyLoss()
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 40)
            optimizer.step()
            if rank == 0 and i % 20 == 0:
                print(f"Epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"({time.time() - start:.1f}s)", flush=True)
        scheduler.step()

        model.eval()
        stats = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                stats[0] += (model.module(x).argmax(1) == y).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats)
        acc = (100 * stats[0] / stats[1]).item()
        if rank == 0:
            print(f"Epoch {epoch}: test acc {acc:.2f}", flush=True)
            if acc > best:
                best = acc
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.output, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best test accuracy {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
