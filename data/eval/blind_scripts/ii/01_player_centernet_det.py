#!/usr/bin/env python
"""Player detection on broadcast frames (CenterNet-style heatmap head).

A ResNet-18 encoder with three transposed-conv stages predicts, at stride 4,
a player-centre heatmap, box width/height and a sub-pixel offset. Frames come
from the per-match dumps written by tools/extract_frames.py; annotations are
MOT-style csv files (frame, track_id, x, y, w, h) per match.
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
STRIDE = 4


def parse_args():
    p = argparse.ArgumentParser(description="CenterNet player detector")
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--split-file", type=Path, required=True, help="json: {'train': [...], 'val': [...]} match ids")
    p.add_argument("--out-dir", type=Path, default=Path("runs/player_det"))
    p.add_argument("--input-size", type=int, nargs=2, default=[544, 960], metavar=("H", "W"))
    p.add_argument("--batch-size", type=int, default=16, help="images per GPU")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=2.5e-4, help="lr for a global batch of 64")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


def gaussian_radius(h, w, min_overlap=0.7):
    # CornerNet radius, third case only is enough for small boxes
    a, b = 4, 2 * (h + w)
    c = (min_overlap - 1) * w * h
    return max(0, int((b + math.sqrt(b ** 2 - 4 * a * c)) / (2 * a) / 4))


def draw_gaussian(hm, cx, cy, radius):
    d = 2 * radius + 1
    sigma = d / 6
    ys, xs = np.ogrid[-radius:radius + 1, -radius:radius + 1]
    g = np.exp(-(xs * xs + ys * ys) / (2 * sigma * sigma))
    H, W = hm.shape
    l, r = min(cx, radius), min(W - cx, radius + 1)
    t, b = min(cy, radius), min(H - cy, radius + 1)
    np.maximum(hm[cy - t:cy + b, cx - l:cx + r], g[radius - t:radius + b, radius - l:radius + r],
               out=hm[cy - t:cy + b, cx - l:cx + r])


class PlayerFrames(Dataset):
    max_objs = 64

    def __init__(self, root, match_ids, size, train=True):
        self.size = size
        self.train = train
        self.samples = []
        for mid in match_ids:
            gt = pd.read_csv(root / mid / "gt.csv", names=["frame", "tid", "x", "y", "w", "h"])
            for frame, rows in gt.groupby("frame"):
                img = root / mid / "img1" / f"{frame:06d}.jpg"
                self.samples.append((img, rows[["x", "y", "w", "h"]].to_numpy(np.float32)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, boxes = self.samples[idx]
        img = Image.open(path).convert("RGB")
        W0, H0 = img.size
        H, W = self.size
        img = img.resize((W, H), Image.BILINEAR)
        boxes = boxes * np.array([W / W0, H / H0, W / W0, H / H0], dtype=np.float32)
        arr = np.asarray(img, dtype=np.float32) / 255.0
        if self.train and np.random.rand() < 0.5:
            arr = arr[:, ::-1]
            boxes[:, 0] = W - boxes[:, 0] - boxes[:, 2]
        arr = (arr - MEAN) / STD

        oh, ow = H // STRIDE, W // STRIDE
        hm = np.zeros((oh, ow), np.float32)
        wh = np.zeros((self.max_objs, 2), np.float32)
        off = np.zeros((self.max_objs, 2), np.float32)
        ind = np.zeros(self.max_objs, np.int64)
        mask = np.zeros(self.max_objs, np.float32)
        for k, (x, y, w, h) in enumerate(boxes[: self.max_objs]):
            cx, cy = (x + w / 2) / STRIDE, (y + h / 2) / STRIDE
            ix, iy = int(cx), int(cy)
            if not (0 <= ix < ow and 0 <= iy < oh):
                continue
            draw_gaussian(hm, ix, iy, gaussian_radius(h / STRIDE, w / STRIDE))
            wh[k] = (w / STRIDE, h / STRIDE)
            off[k] = (cx - ix, cy - iy)
            ind[k] = iy * ow + ix
            mask[k] = 1
        return {
            "image": torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))),
            "hm": torch.from_numpy(hm)[None],
            "wh": torch.from_numpy(wh), "off": torch.from_numpy(off),
            "ind": torch.from_numpy(ind), "mask": torch.from_numpy(mask),
        }


def _head(cin, cout, bias=0.0):
    conv = nn.Conv2d(64, cout, 1)
    nn.init.constant_(conv.bias, bias)
    return nn.Sequential(nn.Conv2d(cin, 64, 3, padding=1), nn.ReLU(inplace=True), conv)


class CenterNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights=torchvision.models.ResNet18_Weights.IMAGENET1K_V1)
        self.encoder = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        ups, cin = [], 512
        for cout in (256, 128, 64):
            ups += [nn.ConvTranspose2d(cin, cout, 4, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
        self.decoder = nn.Sequential(*ups)
        self.hm = _head(64, 1, bias=-2.19)
        self.wh = _head(64, 2)
        self.off = _head(64, 2)

    def forward(self, x):
        f = self.decoder(self.encoder(x))
        return self.hm(f), self.wh(f), self.off(f)


def focal_loss(pred_logits, gt):
    pred = pred_logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg_w = torch.pow(1 - gt, 4)
    pos_loss = torch.log(pred) * torch.pow(1 - pred, 2) * pos
    neg_loss = torch.log(1 - pred) * torch.pow(pred, 2) * neg_w * (1 - pos)
    num_pos = pos.sum().clamp(min=1)
    return -(pos_loss.sum() + neg_loss.sum()) / num_pos


def gather_feat(fmap, ind):
    b, c = fmap.shape[:2]
    fmap = fmap.view(b, c, -1).permute(0, 2, 1)
    return fmap.gather(1, ind.unsqueeze(2).expand(-1, -1, c))


def compute_loss(out, batch):
    hm, wh, off = out
    m = batch["mask"].unsqueeze(2)
    l_hm = focal_loss(hm, batch["hm"])
    l_wh = (F.l1_loss(gather_feat(wh, batch["ind"]) * m, batch["wh"] * m, reduction="sum") / (m.sum() + 1e-4))
    l_off = (F.l1_loss(gather_feat(off, batch["ind"]) * m, batch["off"] * m, reduction="sum") / (m.sum() + 1e-4))
    return l_hm + 0.1 * l_wh + l_off, (l_hm.detach(), l_wh.detach(), l_off.detach())


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss, _ = compute_loss(model(batch["image"]), batch)
        total += torch.stack([loss * batch["image"].size(0), torch.tensor(float(batch["image"].size(0)), device=device)])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(1234)

    splits = json.loads(args.split_file.read_text())
    train_ds = PlayerFrames(args.data_root, splits["train"], args.input_size, train=True)
    val_ds = PlayerFrames(args.data_root, splits["val"], args.input_size, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # unpadded shard so every val frame is counted exactly once
    val_shard = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = CenterNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[device.index])

    lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
                                                    pct_start=0.05)
    start_epoch, best = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    writer = None
    if rank == 0:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(args.out_dir / "tb")
        print(f"world={world} train_frames={len(train_ds)} val_frames={len(val_ds)} lr={lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss, (l_hm, l_wh, l_off) = compute_loss(model(batch["image"]), batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % args.log_every == 0:
                step = epoch * steps_per_epoch + it
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/hm", l_hm.item(), step)
                writer.add_scalar("train/wh", l_wh.item(), step)
                writer.add_scalar("train/off", l_off.item(), step)
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"({(time.time() - t0) / (it + 1):.2f}s/it)")

        val_loss = validate(model.module, val_loader, device)
        if rank == 0:
            writer.add_scalar("val/loss", val_loss, epoch)
            is_best = val_loss < best
            best = min(best, val_loss)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, args.out_dir / "last.pth")
            if is_best:
                torch.save(state, args.out_dir / "best.pth")
            print(f"epoch {epoch} val_loss {val_loss:.4f} best {best:.4f}")
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
