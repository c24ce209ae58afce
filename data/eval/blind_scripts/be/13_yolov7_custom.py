"""YOLOv7-tiny fine-tuning on a flat folder of labelled images (images/*.jpg + labels/*.txt).
The folder has no predefined split, so a hold-out set is carved out at start-up.

    torchrun --nproc_per_node=4 13_yolov7_custom.py --source /data/warehouse_pallets --nc 3 --epochs 150
"""
import argparse
import glob
import math
import os
import random
from copy import deepcopy
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from models.yolo import Model
from utils.datasets import load_mosaic, letterbox, random_perspective
from utils.loss import ComputeLossOTA
from utils.torch_utils import ModelEMA, is_parallel
from utils.general import non_max_suppression, xywhn2xyxy, xyxy2xywhn
from utils.metrics import ap_per_class, process_batch

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


def init_seeds(seed=0):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_files(source, val_frac=0.1):
    files = sorted(glob.glob(os.path.join(source, "images", "*.jpg")))
    random.shuffle(files)
    n_val = max(1, int(len(files) * val_frac))
    return files[n_val:], files[:n_val]


class FolderDataset(Dataset):
    def __init__(self, img_files, img_size=640, augment=False, hyp=None):
        self.img_files = img_files
        self.img_size = img_size
        self.augment = augment
        self.hyp = hyp
        self.mosaic_border = [-img_size // 2, -img_size // 2]
        self.indices = range(len(img_files))
        self.labels = []
        for f in img_files:
            lf = f.replace("/images/", "/labels/").rsplit(".", 1)[0] + ".txt"
            if os.path.isfile(lf):
                lb = np.loadtxt(lf, ndmin=2, dtype=np.float32).reshape(-1, 5)
            else:
                lb = np.zeros((0, 5), dtype=np.float32)
            self.labels.append(lb)

    def __len__(self):
        return len(self.img_files)

    def load_image(self, i):
        img = cv2.imread(self.img_files[i])
        h0, w0 = img.shape[:2]
        r = self.img_size / max(h0, w0)
        if r != 1:
            img = cv2.resize(img, (int(w0 * r), int(h0 * r)), interpolation=cv2.INTER_AREA if r < 1 else cv2.INTER_LINEAR)
        return img, (h0, w0), img.shape[:2]

    def __getitem__(self, index):
        if self.augment and random.random() < self.hyp["mosaic"]:
            img, labels = load_mosaic(self, index)
        else:
            img, _, (h, w) = self.load_image(index)
            img, ratio, pad = letterbox(img, self.img_size, auto=False, scaleup=self.augment)
            labels = self.labels[index].copy()
            if labels.size:
                labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w, ratio[1] * h, padw=pad[0], padh=pad[1])
            if self.augment:
                img, labels = random_perspective(img, labels, degrees=self.hyp["degrees"],
                                                 translate=self.hyp["translate"], scale=self.hyp["scale"])
        if self.augment and random.random() < self.hyp["fliplr"]:
            img = np.fliplr(img)
            if len(labels):
                labels[:, [1, 3]] = img.shape[1] - labels[:, [3, 1]]
        out = torch.zeros((len(labels), 6))
        if len(labels):
            labels[:, 1:5] = xyxy2xywhn(labels[:, 1:5], w=img.shape[1], h=img.shape[0])
            out[:, 1:] = torch.from_numpy(labels)
        img = np.ascontiguousarray(img[:, :, ::-1].transpose(2, 0, 1))
        return torch.from_numpy(img), out

    @staticmethod
    def collate_fn(batch):
        img, label = zip(*batch)
        for i, l in enumerate(label):
            l[:, 0] = i
        return torch.stack(img, 0), torch.cat(label, 0)


@torch.no_grad()
def validate(model, loader, nc, device):
    model.eval()
    iouv = torch.linspace(0.5, 0.95, 10, device=device)
    stats = []
    for imgs, targets in loader:
        imgs = imgs.to(device).float() / 255.0
        targets = targets.to(device)
        _, _, h, w = imgs.shape
        out, _ = model(imgs)
        out = non_max_suppression(out, conf_thres=0.001, iou_thres=0.65)
        for si, pred in enumerate(out):
            labels = targets[targets[:, 0] == si, 1:]
            if len(pred) == 0:
                if len(labels):
                    stats.append((torch.zeros(0, 10, dtype=torch.bool), torch.Tensor(), torch.Tensor(), labels[:, 0].cpu()))
                continue
            tbox = xywhn2xyxy(labels[:, 1:5], w, h)
            correct = process_batch(pred, torch.cat((labels[:, 0:1], tbox), 1), iouv)
            stats.append((correct.cpu(), pred[:, 4].cpu(), pred[:, 5].cpu(), labels[:, 0].cpu()))
    stats = [torch.cat(x, 0).numpy() for x in zip(*stats)]
    if len(stats) and stats[0].any():
        p, r, ap, f1, ap_class = ap_per_class(*stats)
        return p.mean(), r.mean(), ap[:, 0].mean(), ap.mean(1).mean()
    return 0.0, 0.0, 0.0, 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--cfg", default="cfg/training/yolov7-tiny.yaml")
    ap.add_argument("--weights", default="yolov7-tiny.pt")
    ap.add_argument("--nc", type=int, required=True)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--img-size", type=int, default=640)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--project", default="runs/custom")
    opt = ap.parse_args()

    torch.cuda.set_device(LOCAL_RANK)
    dist.init_process_group("nccl")
    device = torch.device("cuda", LOCAL_RANK)
    init_seeds(opt.seed + 1 + RANK)  # per-rank seed for different augmentations on each GPU

    hyp = dict(lr0=0.01, lrf=0.01, momentum=0.937, weight_decay=5e-4, warmup_epochs=3, mosaic=1.0,
               fliplr=0.5, degrees=0.0, translate=0.1, scale=0.5, box=0.05, cls=0.5, obj=1.0,
               anchor_t=4.0, iou_t=0.2, cls_pw=1.0, obj_pw=1.0, fl_gamma=0.0, label_smoothing=0.0)
    train_files, val_files = split_files(opt.source, val_frac=0.1)
    train_set = FolderDataset(train_files, opt.img_size, augment=True, hyp=hyp)
    val_set = FolderDataset(val_files, opt.img_size, augment=False, hyp=hyp)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=opt.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, collate_fn=FolderDataset.collate_fn)
    val_loader = DataLoader(val_set, batch_size=opt.batch_size * 2, shuffle=False, num_workers=8,
                            pin_memory=True, collate_fn=FolderDataset.collate_fn)

    ckpt = torch.load(opt.weights, map_location="cpu")
    model = Model(opt.cfg, ch=3, nc=opt.nc, anchors=hyp.get("anchors"))
    csd = {k: v for k, v in ckpt["model"].float().state_dict().items()
           if k in model.state_dict() and v.shape == model.state_dict()[k].shape}
    model.load_state_dict(csd, strict=False)
    model.nc, model.hyp, model.gr = opt.nc, hyp, 1.0
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    compute_loss = ComputeLossOTA(model)
    ema = ModelEMA(model) if RANK == 0 else None
    model = DDP(model, device_ids=[LOCAL_RANK], output_device=LOCAL_RANK)

    optimizer = torch.optim.SGD(model.parameters(), lr=hyp["lr0"], momentum=hyp["momentum"], nesterov=True,
                                weight_decay=hyp["weight_decay"])
    lf = lambda x: ((1 - math.cos(x * math.pi / opt.epochs)) / 2) * (hyp["lrf"] - 1) + 1
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    scaler = torch.cuda.amp.GradScaler()

    save_dir = Path(opt.project)
    if RANK == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 1000)
    best_fitness = 0.0
    for epoch in range(opt.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for i, (imgs, targets) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255.0
            if ni <= nw:
                for g in optimizer.param_groups:
                    g["lr"] = np.interp(ni, [0, nw], [0.0, g["initial_lr"] * lf(epoch)])
                    g["momentum"] = np.interp(ni, [0, nw], [0.8, hyp["momentum"]])
            with torch.cuda.amp.autocast():
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device), imgs)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if ema:
                ema.update(model)
            if RANK == 0 and i % 50 == 0:
                print(f"{epoch}/{opt.epochs - 1} [{i}/{nb}] box {loss_items[0]:.4f} obj {loss_items[1]:.4f} "
                      f"cls {loss_items[2]:.4f}", flush=True)
        scheduler.step()

        if RANK == 0:
            p, r, map50, map5095 = validate(ema.ema, val_loader, opt.nc, device)
            fitness = 0.1 * map50 + 0.9 * map5095
            print(f"epoch {epoch}: P {p:.3f} R {r:.3f} mAP@.5 {map50:.3f} mAP@.5:.95 {map5095:.3f}")
            state = {"epoch": epoch, "model": deepcopy(ema.ema).half(), "optimizer": optimizer.state_dict(),
                     "best_fitness": max(best_fitness, fitness)}
            torch.save(state, save_dir / "last.pt")
            if fitness > best_fitness:
                best_fitness = fitness
                torch.save(state, save_dir / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
