"""
Row-anchor lane detector (ResNet-34) on CULane with the auxiliary segmentation
branch, gradient accumulation and SyncBN.

    torchrun --nproc_per_node=4 13_lane_rowanchor_res34.py --data-root /data/CULane --accum-steps 2
"""
import argparse
import contextlib
import math
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

ROW_ANCHOR = [121, 131, 141, 150, 160, 170, 180, 189, 199, 209, 219, 228, 238, 248, 258, 267, 277, 287]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--log-dir", default="runs/culane_res34")
    p.add_argument("--griding", type=int, default=200)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU, per micro-step")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--base-lr", type=float, default=0.025, help="for an effective batch of 32")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--aux-weight", type=float, default=1.0)
    p.add_argument("--no-aux", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class CULane(Dataset):
    def __init__(self, root, list_name, griding, lanes, train):
        self.root, self.griding, self.lanes, self.train = root, griding, lanes, train
        with open(os.path.join(root, "list", list_name)) as f:
            self.lines = [l.split() for l in f if l.strip()]
        self.mean = np.array([0.485, 0.456, 0.406], np.float32)
        self.std = np.array([0.229, 0.224, 0.225], np.float32)

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        img = cv2.imread(self.root + self.lines[i][0])[:, :, ::-1]
        seg = cv2.imread(self.root + self.lines[i][1], cv2.IMREAD_GRAYSCALE)
        if self.train:
            ang = np.random.uniform(-6, 6)
            M = cv2.getRotationMatrix2D((img.shape[1] / 2, img.shape[0] / 2), ang, 1.0)
            M[0, 2] += np.random.randint(-200, 201)
            M[1, 2] += np.random.randint(-20, 21)
            img = cv2.warpAffine(np.ascontiguousarray(img), M, img.shape[1::-1])
            seg = cv2.warpAffine(seg, M, seg.shape[::-1], flags=cv2.INTER_NEAREST)
        h, w = seg.shape
        cols = np.linspace(0, w - 1, self.griding)
        label = np.full((len(ROW_ANCHOR), self.lanes), self.griding, np.int64)
        for r, y in enumerate(ROW_ANCHOR):
            row = seg[int(round(y * h / 288))]
            for k in range(self.lanes):
                xs = np.nonzero(row == k + 1)[0]
                if len(xs):
                    label[r, k] = int(np.abs(cols - xs.mean()).argmin())
        seg_small = cv2.resize(seg, (100, 36), interpolation=cv2.INTER_NEAREST).astype(np.int64)
        seg_small[seg_small > self.lanes] = 0
        img = (cv2.resize(np.ascontiguousarray(img), (800, 288)).astype(np.float32) / 255.0 - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(label), torch.from_numpy(seg_small)


class Shard(Sampler):
    def __init__(self, n, rank, world):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


def conv_bn_relu(cin, cout, k=3, d=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=d * (k // 2), dilation=d, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class LaneNet(nn.Module):
    def __init__(self, griding, rows, lanes, use_aux):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.layer2, self.layer3, self.layer4 = r.layer2, r.layer3, r.layer4
        self.cls_dim = (griding + 1, rows, lanes)
        self.pool = nn.Conv2d(512, 8, 1)
        self.cls = nn.Sequential(nn.Linear(1800, 2048), nn.ReLU(), nn.Linear(2048, int(np.prod(self.cls_dim))))
        self.use_aux = use_aux
        if use_aux:
            self.aux2 = nn.Sequential(conv_bn_relu(128, 128), conv_bn_relu(128, 128))
            self.aux3 = nn.Sequential(conv_bn_relu(256, 128), conv_bn_relu(128, 128))
            self.aux4 = nn.Sequential(conv_bn_relu(512, 128), conv_bn_relu(128, 128))
            self.aux_comb = nn.Sequential(conv_bn_relu(384, 256, d=2), conv_bn_relu(256, 128, d=2),
                                          conv_bn_relu(128, 128, d=4), nn.Conv2d(128, lanes + 1, 1))

    def forward(self, x):
        x2 = self.layer2(self.stem(x))
        x3 = self.layer3(x2)
        x4 = self.layer4(x3)
        cls = self.cls(self.pool(x4).flatten(1)).view(-1, *self.cls_dim)
        if not self.use_aux:
            return cls, None
        size = x2.shape[-2:]
        a3 = F.interpolate(self.aux3(x3), size=size, mode="bilinear", align_corners=False)
        a4 = F.interpolate(self.aux4(x4), size=size, mode="bilinear", align_corners=False)
        seg = self.aux_comb(torch.cat([self.aux2(x2), a3, a4], 1))
        return cls, seg


@torch.no_grad()
def row_accuracy(net, loader, griding):
    net.eval()
    s = torch.zeros(2, device="cuda", dtype=torch.float64)
    for img, label, _ in loader:
        cls, _ = net(img.cuda(non_blocking=True))
        label = label.cuda()
        valid = label != griding
        s[0] += ((cls.argmax(1) == label) & valid).sum()
        s[1] += valid.sum()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)

    train_set = CULane(args.data_root, "train_gt.txt", args.griding, args.lanes, train=True)
    val_set = CULane(args.data_root, "val_gt.txt", args.griding, args.lanes, train=False)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 64, sampler=Shard(len(val_set), rank, world), num_workers=4, pin_memory=True)

    net = LaneNet(args.griding, len(ROW_ANCHOR), args.lanes, use_aux=not args.no_aux)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda()
    # SyncBN keeps running stats identical on all ranks, so no buffer broadcast needed before each forward
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)

    eff_batch = args.batch_size * args.accum_steps * world
    lr = args.base_lr * eff_batch / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    updates_per_epoch = len(loader) // args.accum_steps
    total_updates = args.epochs * updates_per_epoch
    warmup = min(500, total_updates // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: (u + 1) / warmup if u < warmup else 0.5 * (1 + math.cos(math.pi * (u - warmup) / (total_updates - warmup))))

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    update = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        optimizer.zero_grad(set_to_none=True)
        n_micro = updates_per_epoch * args.accum_steps  # same on every rank (drop_last everywhere)
        for i, (img, label, seg) in enumerate(loader):
            if i >= n_micro:
                break
            img, label, seg = img.cuda(non_blocking=True), label.cuda(non_blocking=True), seg.cuda(non_blocking=True)
            last_micro = (i + 1) % args.accum_steps == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                cls, seg_out = model(img)
                loss = F.cross_entropy(cls, label)
                if seg_out is not None:
                    loss = loss + args.aux_weight * F.cross_entropy(seg_out, seg)
                (loss / args.accum_steps).backward()
            if last_micro:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                update += 1
                if writer is not None and update % 20 == 0:
                    writer.add_scalar("train/loss", loss.item(), update)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], update)

        acc = row_accuracy(net, val_loader, args.griding)
        if rank == 0:
            writer.add_scalar("val/row_top1", acc, epoch)
            print(f"epoch {epoch} val top1 {acc:.4f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.log_dir, "last.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
