#!/usr/bin/env python
"""Siamese change detection (LEVIR-CD / WHU-CD) with a shared ResNet encoder.

torchrun --nproc_per_node=8 train_cd.py --config configs/levir_resnet18.yaml
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


DEFAULTS = dict(
    data_root="/data/LEVIR-CD256",
    backbone="resnet18",
    batch_size=16,
    epochs=200,
    lr=1e-3,
    weight_decay=1e-2,
    num_workers=8,
    deep_supervision=False,
    aux_weight=0.4,
    out_dir="work_dirs/levir_siam",
    seed=42,
)


class LevirCD(Dataset):
    MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
    STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __init__(self, root, split, train):
        self.root = os.path.join(root, split)
        self.names = sorted(os.listdir(os.path.join(self.root, "A")))
        self.train = train

    def __len__(self):
        return len(self.names)

    def _load(self, sub, name):
        return np.asarray(Image.open(os.path.join(self.root, sub, name)))

    def __getitem__(self, i):
        n = self.names[i]
        a = (self._load("A", n).astype(np.float32) / 255.0 - self.MEAN) / self.STD
        b = (self._load("B", n).astype(np.float32) / 255.0 - self.MEAN) / self.STD
        m = (self._load("label", n) > 127).astype(np.int64)
        if self.train:
            if random.random() < 0.5:
                a, b, m = a[:, ::-1], b[:, ::-1], m[:, ::-1]
            if random.random() < 0.5:
                a, b, m = a[::-1], b[::-1], m[::-1]
            k = random.randint(0, 3)
            a, b, m = np.rot90(a, k), np.rot90(b, k), np.rot90(m, k)
            if random.random() < 0.5:
                a, b = b, a  # temporal swap
        a = torch.from_numpy(a.transpose(2, 0, 1).copy())
        b = torch.from_numpy(b.transpose(2, 0, 1).copy())
        return a, b, torch.from_numpy(m.copy())


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout, k=3):
        super().__init__(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SiamDiffNet(nn.Module):
    def __init__(self, backbone="resnet18", deep_supervision=False):
        super().__init__()
        net = getattr(torchvision.models, backbone)(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layers = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4])
        chs = [64, 128, 256, 512] if backbone in ("resnet18", "resnet34") else [256, 512, 1024, 2048]
        self.reduce = nn.ModuleList([ConvBNReLU(c * 2, 64, 1) for c in chs])
        self.fuse = nn.Sequential(ConvBNReLU(64 * 4, 128), ConvBNReLU(128, 64))
        self.head = nn.Conv2d(64, 2, 1)
        self.aux_head = nn.Conv2d(64, 2, 1)
        self.deep_supervision = deep_supervision

    def encode(self, x):
        x = self.stem(x)
        feats = []
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return feats

    def forward(self, a, b):
        size = a.shape[-2:]
        fa, fb = self.encode(a), self.encode(b)
        diffs = []
        for red, xa, xb in zip(self.reduce, fa, fb):
            d = red(torch.cat([torch.abs(xa - xb), xa + xb], dim=1))
            diffs.append(F.interpolate(d, size=fa[0].shape[-2:], mode="bilinear", align_corners=False))
        x = self.fuse(torch.cat(diffs, dim=1))
        out = F.interpolate(self.head(x), size=size, mode="bilinear", align_corners=False)
        if self.training and self.deep_supervision:
            aux = F.interpolate(self.aux_head(diffs[-1]), size=size, mode="bilinear", align_corners=False)
            return out, aux
        return out


def dice_loss(logits, target, eps=1.0):
    p = logits.softmax(1)[:, 1]
    t = target.float()
    inter = (p * t).sum((1, 2))
    return 1 - ((2 * inter + eps) / (p.sum((1, 2)) + t.sum((1, 2)) + eps)).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # tp, fp, fn
    for a, b, m in loader:
        a, b, m = a.to(device), b.to(device), m.to(device)
        pred = model(a, b).argmax(1)
        stats[0] += ((pred == 1) & (m == 1)).sum()
        stats[1] += ((pred == 1) & (m == 0)).sum()
        stats[2] += ((pred == 0) & (m == 1)).sum()
    dist.all_reduce(stats)
    tp, fp, fn = stats.tolist()
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    f1 = 2 * prec * rec / max(prec + rec, 1e-9)
    iou = tp / max(tp + fp + fn, 1)
    model.train()
    return dict(precision=prec, recall=rec, f1=f1, iou=iou)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    train_ds = LevirCD(cfg["data_root"], "train", train=True)
    val_ds = LevirCD(cfg["data_root"], "val", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                            num_workers=cfg["num_workers"], pin_memory=True)

    model = SiamDiffNet(cfg["backbone"], deep_supervision=cfg["deep_supervision"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["epochs"])
    ce = nn.CrossEntropyLoss()

    writer = SummaryWriter(cfg["out_dir"]) if rank == 0 else None
    best_f1, step = 0.0, 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for a, b, m in train_loader:
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            m = m.to(device, non_blocking=True)
            out = model(a, b)
            if isinstance(out, tuple):
                out, aux = out
                loss = ce(out, m) + dice_loss(out, m) + cfg["aux_weight"] * ce(aux, m)
            else:
                loss = ce(out, m) + dice_loss(out, m)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
            step += 1
        scheduler.step()

        metrics = evaluate(model, val_loader, device)
        if rank == 0:
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            print(f"[{epoch:03d}] F1 {metrics['f1']:.4f} IoU {metrics['iou']:.4f} "
                  f"P {metrics['precision']:.4f} R {metrics['recall']:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "f1": metrics["f1"]}
            torch.save(ckpt, os.path.join(cfg["out_dir"], "latest.pth"))
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                torch.save(ckpt, os.path.join(cfg["out_dir"], "best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
