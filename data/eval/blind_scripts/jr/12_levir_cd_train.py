#!/usr/bin/env python
# Binary change detection on LEVIR-CD (1024x1024 pairs cut into 256x256 patches).
# Siamese timm backbone + feature-difference FPN head.
#
#   torchrun --nproc_per_node=4 12_levir_cd_train.py --root /data/LEVIR-CD256 --out runs/levir_r50
#   (resume) ... --resume runs/levir_r50/last.pth
import argparse
import csv
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="folder with A/, B/, label/ and list/{train,val,test}.txt")
    p.add_argument("--out", default="runs/levir")
    p.add_argument("--backbone", default="resnet50")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split evenly over the GPUs")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    return p.parse_args()


class LevirCD(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, "list", f"{split}.txt")) as f:
            self.names = [l.strip() for l in f if l.strip()]
        self.root = root
        self.train = train

    def __len__(self):
        return len(self.names)

    def _img(self, sub, name):
        x = np.asarray(Image.open(os.path.join(self.root, sub, name)).convert("RGB"), np.float32) / 255.0
        return (x.transpose(2, 0, 1) - IMAGENET_MEAN) / IMAGENET_STD

    def __getitem__(self, i):
        n = self.names[i]
        a, b = self._img("A", n), self._img("B", n)
        y = (np.asarray(Image.open(os.path.join(self.root, "label", n)).convert("L")) > 127).astype(np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                a, b, y = a[..., ::-1], b[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                a, b, y = a[..., ::-1, :], b[..., ::-1, :], y[..., ::-1, :]
            if np.random.rand() < 0.5:  # temporal swap: change is symmetric
                a, b = b, a
        return (torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.from_numpy(y.copy()), n)


class SiameseCD(nn.Module):
    def __init__(self, backbone, width=128):
        super().__init__()
        self.encoder = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(1, 2, 3, 4))
        chans = self.encoder.feature_info.channels()
        self.reduce = nn.ModuleList([nn.Sequential(nn.Conv2d(2 * c, width, 1, bias=False), nn.BatchNorm2d(width),
                                                   nn.ReLU(inplace=True)) for c in chans])
        self.head = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.Conv2d(width, 2, 1))

    def forward(self, a, b):
        n = a.shape[0]
        # both dates through the shared encoder in a single pass
        feats = self.encoder(torch.cat([a, b], dim=0))
        out = None
        for red, f in zip(reversed(self.reduce), reversed(feats)):
            fa, fb = f[:n], f[n:]
            d = red(torch.cat([torch.abs(fa - fb), fa * fb], dim=1))
            out = d if out is None else d + F.interpolate(out, size=d.shape[-2:], mode="bilinear", align_corners=False)
        return F.interpolate(self.head(out), size=a.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # tp fp fn
    per_image = []
    for a, b, y, names in loader:
        a, b, y = a.to(device), b.to(device), y.to(device)
        pred = net(a, b).argmax(1)
        tp = ((pred == 1) & (y == 1)).flatten(1).sum(1)
        fp = ((pred == 1) & (y == 0)).flatten(1).sum(1)
        fn = ((pred == 0) & (y == 1)).flatten(1).sum(1)
        totals += torch.stack([tp.sum(), fp.sum(), fn.sum()]).double()
        for n, t, p_, f in zip(names, tp.tolist(), fp.tolist(), fn.tolist()):
            per_image.append((n, t, p_, f))
    dist.all_reduce(totals)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_image)
    tp, fp, fn = totals.tolist()
    f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
    iou = tp / max(tp + fp + fn, 1.0)
    net.train()
    return f1, iou, [row for part in gathered for row in part]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_ds = LevirCD(args.root, "train", train=True)
    val_ds = LevirCD(args.root, "val", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    assert args.batch_size % world == 0, "global batch must be divisible by the number of GPUs"
    train_dl = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=16,
                        num_workers=args.workers, pin_memory=True)

    # rank 0 fetches the ImageNet weights into the hub cache, the other ranks read them afterwards
    if rank != 0:
        dist.barrier()
    net = SiameseCD(args.backbone)
    if rank == 0:
        dist.barrier()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 - e / args.epochs)
    weights = torch.tensor([0.2, 0.8], device=device)

    start_epoch, best_f1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt["best_f1"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for a, b, y, _ in train_dl:
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(a, b)
            loss = F.cross_entropy(logits, y, weight=weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
        scheduler.step()
        dist.all_reduce(loss_meter)

        f1, iou, rows = evaluate(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"F1 {f1:.4f} IoU {iou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            is_best = f1 > best_f1
            best_f1 = max(f1, best_f1)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f1": best_f1}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.out, "best.pth"))
                with open(os.path.join(args.out, "best_per_image.csv"), "w", newline="") as f:
                    w = csv.writer(f)
                    w.writerow(["name", "tp", "fp", "fn"])
                    w.writerows(sorted(rows))
        # keep best_f1 identical on all ranks
        best_t = torch.tensor([best_f1], device=device)
        dist.broadcast(best_t, src=0)
        best_f1 = best_t.item()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
