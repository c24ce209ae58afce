#!/usr/bin/env python
"""Siamese change detection on OSCD (Onera Satellite Change Detection), Sentinel-2 L1C, 13 bands.

The encoder is shared between the two acquisition dates; the decoder takes the
absolute difference of the multi-scale features of both dates.

    torchrun --nproc_per_node=4 01_oscd_siamese_change.py --data-root /data/oscd --epochs 100
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

S2_BANDS = ["B01", "B02", "B03", "B04", "B05", "B06", "B07",
            "B08", "B8A", "B09", "B10", "B11", "B12"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", type=str, required=True)
    p.add_argument("--out-dir", type=str, default="runs/oscd_siam")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--crop", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--samples-per-city", type=int, default=200)
    p.add_argument("--pos-weight", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_city(city_dir, date_folder):
    bands = []
    for b in S2_BANDS:
        path = city_dir / date_folder / f"{b}.tif"
        with rasterio.open(path) as src:
            bands.append(src.read(1).astype(np.float32))
    h = min(x.shape[0] for x in bands)
    w = min(x.shape[1] for x in bands)
    arr = np.stack([x[:h, :w] for x in bands])
    return np.clip(arr / 10000.0, 0.0, 1.0)


class OSCDPatches(Dataset):
    def __init__(self, root, split, crop, samples_per_city):
        root = Path(root)
        with open(root / f"{split}.txt") as f:
            cities = [c.strip() for c in f.read().split(",") if c.strip()]
        self.crop = crop
        self.split = split
        self.samples_per_city = samples_per_city
        self.items = []
        for city in cities:
            img1 = read_city(root / "images" / city, "imgs_1_rect")
            img2 = read_city(root / "images" / city, "imgs_2_rect")
            cm = np.array(Image.open(root / "labels" / city / "cm" / "cm.png").convert("L"))
            cm = (cm[: img1.shape[1], : img1.shape[2]] > 0).astype(np.int64)
            self.items.append((city, img1, img2, cm))
        if split == "train":
            self.index = [i for i in range(len(self.items)) for _ in range(samples_per_city)]
        else:
            self.index = list(range(len(self.items)))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        city, img1, img2, cm = self.items[self.index[i]]
        if self.split == "train":
            _, h, w = img1.shape
            y = random.randint(0, h - self.crop)
            x = random.randint(0, w - self.crop)
            a = img1[:, y:y + self.crop, x:x + self.crop]
            b = img2[:, y:y + self.crop, x:x + self.crop]
            m = cm[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                a, b, m = a[:, :, ::-1], b[:, :, ::-1], m[:, ::-1]
            k = random.randint(0, 3)
            a, b, m = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2)), np.rot90(m, k)
        else:
            # full scene, cut to a multiple of 32 for the encoder strides
            _, h, w = img1.shape
            h32, w32 = h - h % 32, w - w % 32
            a, b, m = img1[:, :h32, :w32], img2[:, :h32, :w32], cm[:h32, :w32]
        return (torch.from_numpy(np.ascontiguousarray(a)),
                torch.from_numpy(np.ascontiguousarray(b)),
                torch.from_numpy(np.ascontiguousarray(m)))


class ResNetEncoder(nn.Module):
    def __init__(self, in_chans=13):
        super().__init__()
        net = torchvision.models.resnet18(weights=None)
        net.conv1 = nn.Conv2d(in_chans, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu)
        self.pool = net.maxpool
        self.layers = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4])

    def forward(self, x):
        feats = []
        x = self.stem(x)
        feats.append(x)
        x = self.pool(x)
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return feats


class DiffDecoder(nn.Module):
    def __init__(self, chans=(64, 64, 128, 256, 512), width=64, num_classes=2):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(c, width, 1) for c in chans])
        self.fuse = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        )
        self.cls = nn.Conv2d(width, num_classes, 1)

    def forward(self, feats_a, feats_b):
        out = None
        for lat, fa, fb in zip(reversed(self.lateral), reversed(feats_a), reversed(feats_b)):
            d = lat(torch.abs(fa - fb))
            if out is None:
                out = d
            else:
                out = F.interpolate(out, size=d.shape[-2:], mode="bilinear", align_corners=False) + d
        out = self.fuse(out)
        out = F.interpolate(out, scale_factor=2, mode="bilinear", align_corners=False)
        return self.cls(out)


@torch.no_grad()
def evaluate(encoder, decoder, loader, device):
    # plain modules here: every rank sees a different number of scenes
    encoder = encoder.module
    decoder = decoder.module
    encoder.eval()
    decoder.eval()
    conf = torch.zeros(2, 2, dtype=torch.long, device=device)
    for a, b, m in loader:
        a, b, m = a.to(device), b.to(device), m.to(device)
        logits = decoder(encoder(a), encoder(b))
        pred = logits.argmax(1)
        idx = m.flatten() * 2 + pred.flatten()
        conf += torch.bincount(idx, minlength=4).view(2, 2)
    dist.all_reduce(conf)
    tn, fp, fn, tp = conf.flatten().tolist()
    precision = tp / max(tp + fp, 1)
    recall = tp / max(tp + fn, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-8)
    iou = tp / max(tp + fp + fn, 1)
    encoder.train()
    decoder.train()
    return {"precision": precision, "recall": recall, "f1": f1, "iou_change": iou}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    out_dir = Path(args.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set = OSCDPatches(args.data_root, "train", args.crop, args.samples_per_city)
    val_set = OSCDPatches(args.data_root, "test", args.crop, 1)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    # no padding for the scene-level test set, each scene is scored exactly once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=2)

    encoder = ResNetEncoder(in_chans=len(S2_BANDS)).to(device)
    decoder = DiffDecoder().to(device)
    encoder = DDP(encoder, device_ids=[local_rank])
    decoder = DDP(decoder, device_ids=[local_rank])

    params = list(encoder.parameters()) + list(decoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    class_weights = torch.tensor([1.0, args.pos_weight], device=device)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (a, b, m) in enumerate(train_loader):
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            m = m.to(device, non_blocking=True)

            feats_a = encoder(a)
            feats_b = encoder(b)
            logits = decoder(feats_a, feats_b)
            loss = F.cross_entropy(logits, m, weight=class_weights)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            running[0] += loss.detach()
            running[1] += 1
        scheduler.step()

        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()
        metrics = evaluate(encoder, decoder, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {train_loss:.4f} f1 {metrics['f1']:.4f} "
                  f"iou {metrics['iou_change']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {
                "encoder": encoder.module.state_dict(),
                "decoder": decoder.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "metrics": metrics,
            }
            torch.save(state, out_dir / "last.pt")
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                torch.save(state, out_dir / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
