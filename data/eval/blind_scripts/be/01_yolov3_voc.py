"""YOLOv3 training on Pascal VOC (YOLO txt labels), multi-GPU with DDP.

Usage:
    torchrun --nproc_per_node 4 01_yolov3_voc.py --data data/voc --epochs 100
"""
import argparse
import hashlib
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from models.yolo import YOLOv3, YOLOLoss
from utils.augment import letterbox, random_perspective, augment_hsv
from utils.metrics import ap_per_class, box_iou
from utils.general import non_max_suppression, xywhn2xyxy, xyxy2xywhn

IMG_EXTS = (".jpg", ".jpeg", ".png", ".bmp")
CACHE_VERSION = 0.4


def get_hash(paths):
    size = sum(os.path.getsize(p) for p in paths if os.path.exists(p))
    h = hashlib.md5(str(size).encode())
    h.update("".join(paths).encode())
    return h.hexdigest()


class YoloTxtDataset(Dataset):
    def __init__(self, img_dir, img_size=416, augment=False, hyp=None):
        self.img_size = img_size
        self.augment = augment
        self.hyp = hyp or {}
        self.img_files = sorted(str(p) for p in Path(img_dir).rglob("*") if p.suffix.lower() in IMG_EXTS)
        self.label_files = [p.replace("/images/", "/labels/").rsplit(".", 1)[0] + ".txt" for p in self.img_files]

        cache_path = Path(self.label_files[0]).parent.with_suffix(".cache")
        try:
            cache = np.load(cache_path, allow_pickle=True).item()
            assert cache["version"] == CACHE_VERSION and cache["hash"] == get_hash(self.label_files + self.img_files)
        except Exception:
            cache = self.cache_labels(cache_path)

        self.labels = [cache[f][0] for f in self.img_files]
        self.shapes = np.array([cache[f][1] for f in self.img_files], dtype=np.float64)

    def cache_labels(self, path):
        x = {}
        nm = nf = ne = 0
        for im_file, lb_file in zip(tqdm(self.img_files, desc="Scanning labels"), self.label_files):
            im = Image.open(im_file)
            im.verify()
            shape = im.size
            if os.path.isfile(lb_file):
                nf += 1
                with open(lb_file) as f:
                    lb = np.array([line.split() for line in f.read().strip().splitlines()], dtype=np.float32)
                if len(lb) == 0:
                    ne += 1
                    lb = np.zeros((0, 5), dtype=np.float32)
            else:
                nm += 1
                lb = np.zeros((0, 5), dtype=np.float32)
            x[im_file] = [lb, shape]
        x["hash"] = get_hash(self.label_files + self.img_files)
        x["version"] = CACHE_VERSION
        x["stats"] = (nf, nm, ne)
        np.save(path, x)
        path.with_suffix(".cache.npy").rename(path)
        print(f"Scanned {len(self.img_files)} images: {nf} found, {nm} missing, {ne} empty -> {path}")
        return x

    def __len__(self):
        return len(self.img_files)

    def __getitem__(self, index):
        img = np.array(Image.open(self.img_files[index]).convert("RGB"))[:, :, ::-1]
        h0, w0 = img.shape[:2]
        img, ratio, pad = letterbox(img, self.img_size, auto=False, scaleup=self.augment)
        labels = self.labels[index].copy()
        if labels.size:
            labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w0, ratio[1] * h0, padw=pad[0], padh=pad[1])
        if self.augment:
            img, labels = random_perspective(img, labels, degrees=self.hyp.get("degrees", 0.0),
                                             translate=self.hyp.get("translate", 0.1),
                                             scale=self.hyp.get("scale", 0.5))
            augment_hsv(img, hgain=0.015, sgain=0.7, vgain=0.4)
            if random.random() < 0.5:
                img = np.fliplr(img)
                if len(labels):
                    labels[:, [1, 3]] = img.shape[1] - labels[:, [3, 1]]
        nl = len(labels)
        out = torch.zeros((nl, 6))
        if nl:
            labels[:, 1:5] = xyxy2xywhn(labels[:, 1:5], w=img.shape[1], h=img.shape[0])
            out[:, 1:] = torch.from_numpy(labels)
        img = np.ascontiguousarray(img.transpose(2, 0, 1)[::-1])
        return torch.from_numpy(img), out, self.img_files[index]

    @staticmethod
    def collate_fn(batch):
        imgs, labels, paths = zip(*batch)
        for i, lb in enumerate(labels):
            lb[:, 0] = i  # image index inside the batch
        return torch.stack(imgs, 0), torch.cat(labels, 0), paths


class InferenceSampler(torch.utils.data.Sampler):
    """Shards [0, n) contiguously across ranks without padding, so no image is evaluated twice."""

    def __init__(self, size, rank, world_size):
        shard = size // world_size + int(size % world_size > 0)
        self.indices = range(rank * shard, min((rank + 1) * shard, size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=str, default="data/voc")
    p.add_argument("--cfg", type=str, default="cfg/yolov3.yaml")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup-epochs", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", type=str, default="runs/yolov3_voc")
    p.add_argument("--num-classes", type=int, default=20)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, nc):
    model.eval()
    stats = []
    iouv = torch.linspace(0.5, 0.95, 10, device=device)
    for imgs, targets, _ in loader:
        imgs = imgs.to(device, non_blocking=True).float() / 255.0
        targets = targets.to(device)
        _, _, h, w = imgs.shape
        preds = non_max_suppression(model(imgs), conf_thres=0.001, iou_thres=0.6)
        for si, pred in enumerate(preds):
            labels = targets[targets[:, 0] == si, 1:]
            correct = torch.zeros(pred.shape[0], 10, dtype=torch.bool, device=device)
            if len(labels) and len(pred):
                tbox = xywhn2xyxy(labels[:, 1:5], w, h)
                iou = box_iou(tbox, pred[:, :4])
                for j, thr in enumerate(iouv):
                    x = torch.where((iou >= thr) & (labels[:, 0:1] == pred[:, 5]))
                    if x[0].shape[0]:
                        correct[x[1].unique(), j] = True
            stats.append((correct.cpu(), pred[:, 4].cpu(), pred[:, 5].cpu(), labels[:, 0].cpu()))
    # gather per-image stats from all ranks
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, stats)
    stats = [s for part in world for s in part]
    stats = [torch.cat(x, 0).numpy() for x in zip(*stats)]
    mp, mr, map50, map_ = 0.0, 0.0, 0.0, 0.0
    if len(stats) and stats[0].any():
        p, r, ap, f1, _ = ap_per_class(*stats)
        ap50, ap = ap[:, 0], ap.mean(1)
        mp, mr, map50, map_ = p.mean(), r.mean(), ap50.mean(), ap.mean()
    model.train()
    return mp, mr, map50, map_


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(1 + rank)
    np.random.seed(1 + rank)
    torch.manual_seed(1)

    out_dir = Path(args.out)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    hyp = dict(degrees=0.0, translate=0.1, scale=0.5)
    train_set = YoloTxtDataset(os.path.join(args.data, "images/train"), args.img_size, augment=True, hyp=hyp)
    val_set = YoloTxtDataset(os.path.join(args.data, "images/val"), args.img_size, augment=False)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = InferenceSampler(len(val_set), rank, world_size)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              collate_fn=YoloTxtDataset.collate_fn)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True,
                            collate_fn=YoloTxtDataset.collate_fn)

    model = YOLOv3(args.cfg, nc=args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    criterion = YOLOLoss(model, hyp)  # reads anchors/strides from the detect layer
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    g_bn, g_w, g_b = [], [], []
    for m in model.modules():
        if hasattr(m, "bias") and isinstance(m.bias, nn.Parameter):
            g_b.append(m.bias)
        if isinstance(m, nn.BatchNorm2d):
            g_bn.append(m.weight)
        elif hasattr(m, "weight") and isinstance(m.weight, nn.Parameter):
            g_w.append(m.weight)
    optimizer = torch.optim.SGD(g_bn, lr=args.lr, momentum=0.937, nesterov=True)
    optimizer.add_param_group({"params": g_w, "weight_decay": 5e-4})
    optimizer.add_param_group({"params": g_b})

    lf = lambda e: ((1 - math.cos(e * math.pi / args.epochs)) / 2) * (0.01 - 1) + 1
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    scaler = torch.cuda.amp.GradScaler()

    nb = len(train_loader)
    nw = max(round(args.warmup_epochs * nb), 500)
    best_map = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        mloss = torch.zeros(3, device=device)
        pbar = tqdm(train_loader, total=nb) if rank == 0 else train_loader
        optimizer.zero_grad()
        for i, (imgs, targets, _) in enumerate(pbar):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255.0
            targets = targets.to(device)

            if ni <= nw:
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, [0, nw], [0.1 if j == 2 else 0.0, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, [0, nw], [0.8, 0.937])

            with torch.cuda.amp.autocast():
                pred = model(imgs)
                loss, loss_items = criterion(pred, targets)

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

            mloss = (mloss * i + loss_items) / (i + 1)
            if rank == 0:
                mem = torch.cuda.memory_reserved() / 1e9
                pbar.set_description(f"{epoch}/{args.epochs - 1} {mem:.3g}G "
                                     f"box {mloss[0]:.4f} obj {mloss[1]:.4f} cls {mloss[2]:.4f}")
        scheduler.step()

        mp, mr, map50, map_ = evaluate(model.module, val_loader, device, args.num_classes)
        if rank == 0:
            print(f"epoch {epoch}: P {mp:.3f} R {mr:.3f} mAP@.5 {map50:.4f} mAP@.5:.95 {map_:.4f}")
            ckpt = {"epoch": epoch, "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "best_map": max(best_map, map_)}
            torch.save(ckpt, out_dir / "last.pt")
            if map_ > best_map:
                best_map = map_
                torch.save(ckpt, out_dir / "best.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
