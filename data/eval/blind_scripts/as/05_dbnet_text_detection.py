"""DBNet (Differentiable Binarization) scene-text detector, ResNet-50 + FPN.

Trains on ICDAR2015 / TotalText-style annotations (one txt per image with
comma-separated polygon points and transcription).

    torchrun --nproc_per_node=8 train_dbnet.py --data /data/icdar2015 --batch-size 2 --size 960
"""
import argparse
import glob
import math
import os

import cv2
import numpy as np
import pyclipper
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
from shapely.geometry import Polygon
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--size", type=int, default=960)
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--epochs", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=7e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shrink-ratio", type=float, default=0.4)
    ap.add_argument("--save-dir", default="output/dbnet_r50")
    ap.add_argument("--pretrained", default="weights/synthtext_r50.pth")
    return ap.parse_args()


def load_polys(txt):
    polys, ignore = [], []
    with open(txt, encoding="utf-8-sig") as f:
        for line in f:
            parts = line.strip().split(",")
            if len(parts) < 9:
                continue
            pts = np.array(list(map(float, parts[:8])), dtype=np.float32).reshape(4, 2)
            polys.append(pts)
            ignore.append(parts[8].strip() in ("###", "*"))
    return polys, ignore


class DBDataset(Dataset):
    def __init__(self, root, size, shrink_ratio, min_text=8):
        self.imgs = sorted(glob.glob(os.path.join(root, "train_images", "*.jpg")))
        self.gt_dir = os.path.join(root, "train_gts")
        self.size = size
        self.r = shrink_ratio
        self.min_text = min_text

    def __len__(self):
        return len(self.imgs)

    def _gt_path(self, img_path):
        name = os.path.splitext(os.path.basename(img_path))[0]
        return os.path.join(self.gt_dir, f"gt_{name}.txt")

    def __getitem__(self, i):
        img = cv2.imread(self.imgs[i])[:, :, ::-1]
        polys, ignore = load_polys(self._gt_path(self.imgs[i]))
        h, w = img.shape[:2]
        scale = self.size / max(h, w) * np.random.uniform(0.5, 1.5)
        img = cv2.resize(img, None, fx=scale, fy=scale)
        polys = [p * scale for p in polys]
        angle = np.random.uniform(-10, 10)
        M = cv2.getRotationMatrix2D((img.shape[1] / 2, img.shape[0] / 2), angle, 1.0)
        img = cv2.warpAffine(img, M, (img.shape[1], img.shape[0]))
        polys = [np.hstack([p, np.ones((4, 1))]) @ M.T for p in polys]
        canvas = np.zeros((self.size, self.size, 3), dtype=np.uint8)
        hh, ww = min(img.shape[0], self.size), min(img.shape[1], self.size)
        y0 = np.random.randint(0, img.shape[0] - hh + 1)
        x0 = np.random.randint(0, img.shape[1] - ww + 1)
        canvas[:hh, :ww] = img[y0:y0 + hh, x0:x0 + ww]
        polys = [p - np.array([x0, y0]) for p in polys]

        gt = np.zeros((self.size, self.size), np.float32)
        mask = np.ones((self.size, self.size), np.float32)
        thresh = np.zeros((self.size, self.size), np.float32)
        thresh_mask = np.zeros((self.size, self.size), np.float32)
        for poly, ign in zip(polys, ignore):
            poly = np.clip(poly, 0, self.size - 1)
            pg = Polygon(poly)
            if not pg.is_valid or pg.area < 1:
                continue
            hgt = min(np.linalg.norm(poly[0] - poly[3]), np.linalg.norm(poly[1] - poly[2]))
            if ign or hgt < self.min_text:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
                continue
            d = pg.area * (1 - self.r ** 2) / pg.length
            pco = pyclipper.PyclipperOffset()
            pco.AddPath(poly.astype(np.int64).tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
            shrunk = pco.Execute(-d)
            if not shrunk:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
                continue
            cv2.fillPoly(gt, [np.array(shrunk[0]).reshape(-1, 2).astype(np.int32)], 1)
            dilated = pco.Execute(d)
            if dilated:
                cv2.fillPoly(thresh_mask, [np.array(dilated[0]).reshape(-1, 2).astype(np.int32)], 1)
                cv2.polylines(thresh, [poly.astype(np.int32)], True, 1.0, thickness=max(int(d), 1))
        thresh = thresh * 0.4 + 0.3
        x = (canvas.astype(np.float32) / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
        x = torch.from_numpy(x.transpose(2, 0, 1).astype(np.float32))
        return x, torch.from_numpy(gt), torch.from_numpy(mask), torch.from_numpy(thresh), torch.from_numpy(thresh_mask)


class DBHead(nn.Module):
    def __init__(self, cin, k=50):
        super().__init__()
        self.k = k

        def branch():
            return nn.Sequential(
                nn.Conv2d(cin, cin // 4, 3, padding=1, bias=False), nn.BatchNorm2d(cin // 4), nn.ReLU(True),
                nn.ConvTranspose2d(cin // 4, cin // 4, 2, 2), nn.BatchNorm2d(cin // 4), nn.ReLU(True),
                nn.ConvTranspose2d(cin // 4, 1, 2, 2), nn.Sigmoid())
        self.binarize = branch()
        self.thresh = branch()

    def forward(self, x):
        p = self.binarize(x)
        t = self.thresh(x)
        b = torch.reciprocal(1 + torch.exp(-self.k * (p - t)))
        return p, t, b


class DBNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.stages = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.lateral = nn.ModuleList([nn.Conv2d(c, 256, 1, bias=False) for c in (256, 512, 1024, 2048)])
        self.smooth = nn.ModuleList([nn.Sequential(nn.Conv2d(256, 64, 3, padding=1, bias=False),
                                                   nn.BatchNorm2d(64), nn.ReLU(True)) for _ in range(4)])
        self.head = DBHead(256)

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for s in self.stages:
            x = s(x)
            feats.append(x)
        lat = [l(f) for l, f in zip(self.lateral, feats)]
        for i in range(3, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], size=lat[i - 1].shape[-2:], mode="nearest")
        outs = [F.interpolate(sm(l), size=lat[0].shape[-2:], mode="nearest") for sm, l in zip(self.smooth, lat)]
        return self.head(torch.cat(outs, 1))


def balanced_bce(pred, gt, mask, neg_ratio=3.0):
    pos = (gt * mask).bool()
    neg = ((1 - gt) * mask).bool()
    n_pos = int(pos.sum())
    n_neg = min(int(neg.sum()), int(n_pos * neg_ratio))
    loss = F.binary_cross_entropy(pred, gt, reduction="none")
    neg_loss, _ = loss[neg].topk(n_neg) if n_neg > 0 else (loss.new_zeros(0), None)
    return (loss[pos].sum() + neg_loss.sum()) / (n_pos + n_neg + 1e-6)


def db_loss(p, t, b, gt, mask, thresh, thresh_mask):
    p, t, b = p.squeeze(1), t.squeeze(1), b.squeeze(1)
    l_s = balanced_bce(p, gt, mask)
    l_t = (torch.abs(t - thresh) * thresh_mask).sum() / (thresh_mask.sum() + 1e-6)
    inter = (b * gt * mask).sum()
    l_b = 1 - 2 * inter / ((b * mask).sum() + (gt * mask).sum() + 1e-6)
    return l_s + 10 * l_t + l_b, (l_s.item(), l_t.item(), l_b.item())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    ds = DBDataset(args.data, args.size, args.shrink_ratio)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DBNet()
    if args.pretrained and os.path.isfile(args.pretrained):
        sd = torch.load(args.pretrained, map_location="cpu")
        missing, unexpected = model.load_state_dict(sd.get("state_dict", sd), strict=False)
        if rank == 0:
            print(f"loaded {args.pretrained}: {len(missing)} missing, {len(unexpected)} unexpected")
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (1 - s / total) ** 0.9)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, gt, mask, thresh, tmask in loader:
            x = x.to(device, non_blocking=True)
            gt, mask = gt.to(device), mask.to(device)
            thresh, tmask = thresh.to(device), tmask.to(device)
            p, t, b = model(x)
            loss, (ls, lt, lb) = db_loss(p, t, b, gt, mask, thresh, tmask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} "
                      f"(shrink {ls:.4f} thresh {lt:.4f} binary {lb:.4f}) lr {scheduler.get_last_lr()[0]:.5f}",
                      flush=True)
        if rank == 0 and (epoch + 1) % 50 == 0:
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch,
                        "optimizer": optimizer.state_dict()},
                       os.path.join(args.save_dir, f"epoch_{epoch + 1}.pth"))

    if rank == 0:
        torch.save({"state_dict": model.module.state_dict()}, os.path.join(args.save_dir, "final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
