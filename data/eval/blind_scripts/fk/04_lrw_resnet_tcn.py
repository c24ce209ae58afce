#!/usr/bin/env python3
# Word-level lip reading on LRW (500 words, 29-frame clips).
# 3D conv stem + ResNet-18 trunk + multi-scale TCN back-end, mixup, cosine LR.
#
#   torchrun --standalone --nproc_per_node=8 04_lrw_resnet_tcn.py --data /datasets/lrw_roi
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.resnet import BasicBlock


def get_parser():
    parser = argparse.ArgumentParser(description="LRW lipreading")
    parser.add_argument("--data", required=True, help="dir with <word>/<split>/*.npz mouth ROIs")
    parser.add_argument("--label-file", default="labels/500WordsSortedList.txt")
    parser.add_argument("--logdir", default="runs/lrw_resnet18_mstcn")
    # 29x88x88 clips are heavy for the 3D stem; 8 GPUs x 4 = 32, the paper's batch
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--alpha", type=float, default=0.4, help="mixup alpha")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--resume", default=None)
    return parser


class LRWDataset(Dataset):
    def __init__(self, root, split, words, train):
        self.files, self.labels = [], []
        for idx, w in enumerate(words):
            fs = sorted(glob.glob(os.path.join(root, w, split, "*.npz")))
            self.files += fs
            self.labels += [idx] * len(fs)
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = np.load(self.files[i])["data"].astype(np.float32) / 255.0  # 29 x 96 x 96
        if self.train:
            y0, x0 = random.randint(0, 8), random.randint(0, 8)
            x = x[:, y0:y0 + 88, x0:x0 + 88]
            if random.random() < 0.5:
                x = x[:, :, ::-1]
        else:
            x = x[:, 4:92, 4:92]
        x = (x - 0.421) / 0.165
        return torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(0), self.labels[i]


class ResNetTrunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.inplanes = 64
        self.layer1 = self._make(64, 2, 1)
        self.layer2 = self._make(128, 2, 2)
        self.layer3 = self._make(256, 2, 2)
        self.layer4 = self._make(512, 2, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def _make(self, planes, blocks, stride):
        down = None
        if stride != 1 or self.inplanes != planes:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, down)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.pool(x).flatten(1)


class TemporalBlock(nn.Module):
    def __init__(self, c_in, c_out, k, dilation, drop=0.2):
        super().__init__()
        pad = (k - 1) * dilation // 2
        self.net = nn.Sequential(
            nn.Conv1d(c_in, c_out, k, padding=pad, dilation=dilation), nn.BatchNorm1d(c_out), nn.PReLU(c_out), nn.Dropout(drop),
            nn.Conv1d(c_out, c_out, k, padding=pad, dilation=dilation), nn.BatchNorm1d(c_out), nn.PReLU(c_out), nn.Dropout(drop))
        self.res = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x):
        return F.relu(self.net(x) + self.res(x))


class MultiScaleTCN(nn.Module):
    def __init__(self, c_in=512, hidden=768, kernels=(3, 5, 7), levels=4):
        super().__init__()
        per = hidden // len(kernels)
        self.branches = nn.ModuleList()
        for k in kernels:
            layers, c = [], c_in
            for lvl in range(levels):
                layers.append(TemporalBlock(c, per, k, 2 ** lvl))
                c = per
            self.branches.append(nn.Sequential(*layers))

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], dim=1)


class LipReader(nn.Module):
    def __init__(self, num_classes=500):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.PReLU(64),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.trunk = ResNetTrunk()
        self.tcn = MultiScaleTCN()
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x):  # B x 1 x T x H x W
        b, _, t = x.shape[:3]
        x = self.stem(x).transpose(1, 2).flatten(0, 1)
        x = self.trunk(x).view(b, t, -1).transpose(1, 2)
        x = self.tcn(x).mean(-1)
        return self.fc(x)


def mixup(x, y, alpha):
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], y, y[perm], lam


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    random.seed(rank)

    with open(args.label_file) as f:
        words = [w.strip() for w in f if w.strip()]
    train_ds = LRWDataset(args.data, "train", words, train=True)
    val_ds = LRWDataset(args.data, "val", words, train=False)
    # strided shard for eval (no padding, every clip counted once)
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=32, num_workers=args.workers, pin_memory=True)

    model = LipReader(len(words)).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=5e-6)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
        scheduler.load_state_dict(ckpt["scheduler_state_dict"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    writer = SummaryWriter(args.logdir) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run_loss = time.time(), 0.0
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, ya, yb, lam = mixup(x, y, args.alpha)
            logits = model(x)
            loss = lam * F.cross_entropy(logits, ya) + (1 - lam) * F.cross_entropy(logits, yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run_loss += loss.item()
            if rank == 0 and it % 200 == 199:
                print(f"[{epoch}][{it + 1}/{len(train_loader)}] loss {run_loss / 200:.4f} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)
                writer.add_scalar("train/loss", run_loss / 200, epoch * len(train_loader) + it)
                run_loss = 0.0
        scheduler.step()

        val_loss, val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f} acc {100 * val_acc:.2f}", flush=True)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            state = {"model_state_dict": model.module.state_dict(),
                     "optimizer_state_dict": optimizer.state_dict(),
                     "scheduler_state_dict": scheduler.state_dict(),
                     "epoch": epoch, "best_acc": max(best_acc, val_acc)}
            torch.save(state, os.path.join(args.logdir, "ckpt.pth"))
            if val_acc > best_acc:
                torch.save(state, os.path.join(args.logdir, "ckpt.best.pth"))
        best_acc = max(best_acc, val_acc)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
