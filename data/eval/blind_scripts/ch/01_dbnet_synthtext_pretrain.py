"""DBNet text detection: pre-train on SynthText, fine-tune on ICDAR2015 / TotalText.

Differentiable Binarization (Liao et al. 2020) with a ResNet-18 FPN backbone.
Launch with torchrun, one process per GPU.
"""
import argparse
import json
import math
import os
import random
import time

import cv2
import numpy as np
import pyclipper
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from shapely.geometry import Polygon
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", required=True)
    p.add_argument("--val-json", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out-dir", default="runs/dbnet_r18")
    p.add_argument("--img-size", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.007)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--shrink-ratio", type=float, default=0.4)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


# --------------------------------------------------------------------- data
class DetDataset(Dataset):
    """Each record: {"file": "...", "polys": [[[x, y], ...], ...], "ignore": [bool, ...]}"""

    def __init__(self, json_path, root, img_size, shrink_ratio, train=True):
        with open(json_path) as f:
            self.records = json.load(f)
        self.root = root
        self.size = img_size
        self.r = shrink_ratio
        self.train = train

    def __len__(self):
        return len(self.records)

    def _resize_pad(self, img, polys):
        h, w = img.shape[:2]
        scale = self.size / max(h, w)
        if self.train:
            scale *= random.uniform(0.7, 1.3)
            scale = min(scale, self.size / max(h, w) * 1.3)
        nh, nw = int(h * scale), int(w * scale)
        img = cv2.resize(img, (nw, nh))
        polys = [np.asarray(p, dtype=np.float32) * scale for p in polys]
        canvas = np.zeros((self.size, self.size, 3), dtype=np.uint8)
        y0 = random.randint(0, max(0, nh - self.size)) if self.train else 0
        x0 = random.randint(0, max(0, nw - self.size)) if self.train else 0
        crop = img[y0:y0 + self.size, x0:x0 + self.size]
        canvas[:crop.shape[0], :crop.shape[1]] = crop
        polys = [p - np.array([x0, y0], dtype=np.float32) for p in polys]
        return canvas, polys

    def _shrink(self, poly):
        pg = Polygon(poly)
        if pg.area < 1:
            return None
        d = pg.area * (1 - self.r ** 2) / max(pg.length, 1e-6)
        pco = pyclipper.PyclipperOffset()
        pco.AddPath([tuple(pt) for pt in poly.astype(np.int64)], pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
        out = pco.Execute(-d)
        return np.array(out[0]) if out else None

    def __getitem__(self, idx):
        rec = self.records[idx]
        img = cv2.imread(os.path.join(self.root, rec["file"]), cv2.IMREAD_COLOR)
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        img, polys = self._resize_pad(img, rec["polys"])
        gt = np.zeros((self.size, self.size), np.float32)
        mask = np.ones((self.size, self.size), np.float32)
        thr = np.zeros((self.size, self.size), np.float32)
        thr_mask = np.zeros((self.size, self.size), np.float32)
        for poly, ign in zip(polys, rec.get("ignore", [False] * len(polys))):
            pi = poly.astype(np.int32)
            if ign:
                cv2.fillPoly(mask, [pi], 0)
                continue
            shrunk = self._shrink(poly)
            if shrunk is None:
                cv2.fillPoly(mask, [pi], 0)
                continue
            cv2.fillPoly(gt, [shrunk.astype(np.int32)], 1)
            cv2.polylines(thr, [pi], True, 0.7, thickness=3)
            cv2.fillPoly(thr_mask, [pi], 1)
        thr = thr * 0.4 + 0.3
        x = torch.from_numpy(img).permute(2, 0, 1).float() / 255.0
        x = torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return x, torch.from_numpy(gt), torch.from_numpy(mask), torch.from_numpy(thr), torch.from_numpy(thr_mask)


# -------------------------------------------------------------------- model
class FPN(nn.Module):
    def __init__(self, in_chs=(64, 128, 256, 512), inner=256):
        super().__init__()
        self.lat = nn.ModuleList([nn.Conv2d(c, inner, 1, bias=False) for c in in_chs])
        self.smooth = nn.ModuleList([
            nn.Sequential(nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False), nn.BatchNorm2d(inner // 4), nn.ReLU(True))
            for _ in in_chs
        ])

    def forward(self, feats):
        c2, c3, c4, c5 = [l(f) for l, f in zip(self.lat, feats)]
        p4 = c4 + F.interpolate(c5, size=c4.shape[-2:], mode="nearest")
        p3 = c3 + F.interpolate(p4, size=c3.shape[-2:], mode="nearest")
        p2 = c2 + F.interpolate(p3, size=c2.shape[-2:], mode="nearest")
        outs = [s(p) for s, p in zip(self.smooth, (p2, p3, p4, c5))]
        size = outs[0].shape[-2:]
        return torch.cat([outs[0]] + [F.interpolate(o, size=size, mode="nearest") for o in outs[1:]], dim=1)


class DBHead(nn.Module):
    def __init__(self, ch=256, k=50):
        super().__init__()
        self.k = k

        def branch():
            return nn.Sequential(
                nn.Conv2d(ch, ch // 4, 3, padding=1, bias=False), nn.BatchNorm2d(ch // 4), nn.ReLU(True),
                nn.ConvTranspose2d(ch // 4, ch // 4, 2, 2), nn.BatchNorm2d(ch // 4), nn.ReLU(True),
                nn.ConvTranspose2d(ch // 4, 1, 2, 2), nn.Sigmoid())

        self.prob = branch()
        self.thresh = branch()

    def forward(self, x):
        p = self.prob(x)
        t = self.thresh(x)
        b = torch.reciprocal(1 + torch.exp(-self.k * (p - t)))
        return p.squeeze(1), t.squeeze(1), b.squeeze(1)


class DBNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.neck = FPN()
        self.head = DBHead()

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return self.head(self.neck(feats))


def balanced_bce(pred, gt, mask, neg_ratio=3.0):
    pos = (gt * mask).bool()
    neg = ((1 - gt) * mask).bool()
    n_pos = int(pos.sum())
    n_neg = min(int(neg.sum()), int(n_pos * neg_ratio))
    loss = F.binary_cross_entropy(pred.clamp(1e-6, 1 - 1e-6), gt, reduction="none")
    pos_loss = loss[pos]
    neg_loss, _ = loss[neg].topk(n_neg) if n_neg > 0 else (loss.new_zeros(0), None)
    return (pos_loss.sum() + neg_loss.sum()) / (n_pos + n_neg + 1e-6)


def dice_loss(pred, gt, mask):
    inter = (pred * gt * mask).sum()
    union = (pred * mask).sum() + (gt * mask).sum() + 1e-6
    return 1 - 2.0 * inter / union


def db_loss(out, gt, mask, thr, thr_mask):
    p, t, b = out
    l_prob = balanced_bce(p, gt, mask)
    l_thr = (torch.abs(t - thr) * thr_mask).sum() / (thr_mask.sum() + 1e-6)
    l_bin = dice_loss(b, gt, mask)
    return l_prob + 10.0 * l_thr + l_bin


# -------------------------------------------------------------------- train
def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # tp, pred_pos, gt_pos (pixel level on shrunk maps)
    for x, gt, mask, _, _ in loader:
        x, gt, mask = x.to(device, non_blocking=True), gt.to(device), mask.to(device)
        p, _, _ = model(x)
        pred = (p > 0.3).float() * mask
        stats[0] += (pred * gt).sum()
        stats[1] += pred.sum()
        stats[2] += (gt * mask).sum()
    dist.all_reduce(stats)
    prec = (stats[0] / stats[1].clamp(min=1)).item()
    rec = (stats[0] / stats[2].clamp(min=1)).item()
    f1 = 2 * prec * rec / max(prec + rec, 1e-6)
    model.train()
    return prec, rec, f1


def main():
    args = get_args()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = DetDataset(args.train_json, args.image_root, args.img_size, args.shrink_ratio, train=True)
    val_set = DetDataset(args.val_json, args.image_root, args.img_size, args.shrink_ratio, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # every rank scores a disjoint slice of the val set; counts are summed in evaluate()
    val_part = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_part, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = DBNet().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total_iters = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / total_iters) ** 0.9)

    start_epoch, best_f1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt.get("best_f1", 0.0)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world} per_gpu_batch={args.batch_size} iters/epoch={len(train_loader)}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = 0.0
        for it, (x, gt, mask, thr, thr_mask) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            gt, mask = gt.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            thr, thr_mask = thr.to(device, non_blocking=True), thr_mask.to(device, non_blocking=True)
            out = model(x)
            loss = db_loss(out, gt, mask, thr, thr_mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {running / (it + 1):.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.5f}", flush=True)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            prec, rec, f1 = evaluate(model, val_loader, device)
            if rank == 0:
                print(f"[val] epoch {epoch} P {prec:.4f} R {rec:.4f} F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f1": max(best_f1, f1)}
                torch.save(state, os.path.join(args.out_dir, "last.pth"))
                if f1 > best_f1:
                    torch.save(state, os.path.join(args.out_dir, "best.pth"))
            best_f1 = max(best_f1, f1)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
