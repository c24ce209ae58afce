"""
Lightweight DB text detector (MobileNetV3-large + DBFPN) for document / street-sign photos.
Labels use the PaddleOCR det format:  img_rel_path \t [{"transcription": "...", "points": [[x, y], ...]}, ...]

    torchrun --nproc_per_node=4 10_db_mbv3_det_hmean.py \
        --train-label /data/det/train_label.txt --test-label /data/det/test_label.txt --data-dir /data/det
"""
import argparse
import json
import os
import time

import cv2
import numpy as np
import pyclipper
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from shapely.geometry import Polygon
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import mobilenet_v3_large

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--train-label", required=True)
    p.add_argument("--test-label", required=True)
    p.add_argument("--size", type=int, default=960)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-start", type=int, default=100)
    p.add_argument("--eval-step", type=int, default=10)
    p.add_argument("--output", default="output/det_mbv3_db")
    return p.parse_args()


def read_label_file(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rel, ann = line.rstrip("\n").split("\t")
            items = json.loads(ann)
            polys = [np.array(it["points"], np.float32) for it in items]
            ignore = [it["transcription"] in ("###", "*") for it in items]
            out.append((rel, polys, ignore))
    return out


class DetDataset(Dataset):
    def __init__(self, data_dir, label_file, size, train):
        self.data_dir, self.size, self.train = data_dir, size, train
        self.samples = read_label_file(label_file)

    def __len__(self):
        return len(self.samples)

    def make_maps(self, polys, ignore, s):
        gt = np.zeros((s, s), np.float32)
        mask = np.ones((s, s), np.float32)
        for poly, ig in zip(polys, ignore):
            p = Polygon(poly)
            if ig or not p.is_valid or p.area < 4:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
                continue
            d = p.area * (1 - 0.4 ** 2) / p.length
            off = pyclipper.PyclipperOffset()
            off.AddPath(poly.astype(np.int64).tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
            shrunk = off.Execute(-d)
            if not shrunk:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
                continue
            cv2.fillPoly(gt, [np.array(shrunk[0], np.int32)], 1)
        return gt, mask

    def __getitem__(self, i):
        rel, polys, ignore = self.samples[i]
        img = cv2.imread(os.path.join(self.data_dir, rel))[:, :, ::-1]
        h, w = img.shape[:2]
        s = self.size
        r = s / max(h, w)
        if self.train:
            r *= np.random.uniform(0.7, 1.3)
        img = cv2.resize(img, (int(w * r), int(h * r)))
        polys = [p * r for p in polys]
        canvas = np.zeros((s, s, 3), np.float32)
        hh, ww = min(s, img.shape[0]), min(s, img.shape[1])
        canvas[:hh, :ww] = img[:hh, :ww]
        gt, mask = self.make_maps(polys, ignore, s)
        x = torch.from_numpy(((canvas / 255.0 - MEAN) / STD).transpose(2, 0, 1).copy())
        if self.train:
            return x, torch.from_numpy(gt), torch.from_numpy(mask)
        return x, i, r


def test_collate(b):
    x, idx, r = zip(*b)
    return torch.stack(x), list(idx), list(r)


class DBMobile(nn.Module):
    def __init__(self, inner=96):
        super().__init__()
        feats = mobilenet_v3_large(weights="IMAGENET1K_V1").features
        self.stages = nn.ModuleList([feats[:4], feats[4:7], feats[7:13], feats[13:]])  # /4 /8 /16 /32
        chans = [24, 40, 112, 960]
        self.ins = nn.ModuleList([nn.Conv2d(c, inner, 1, bias=False) for c in chans])
        self.ps = nn.ModuleList([nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False) for _ in chans])
        self.binarize = nn.Sequential(
            nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False), nn.BatchNorm2d(inner // 4), nn.ReLU(True),
            nn.ConvTranspose2d(inner // 4, inner // 4, 2, 2), nn.BatchNorm2d(inner // 4), nn.ReLU(True),
            nn.ConvTranspose2d(inner // 4, 1, 2, 2))

    def forward(self, x):
        outs = []
        for st in self.stages:
            x = st(x)
            outs.append(x)
        lat = [m(o) for m, o in zip(self.ins, outs)]
        for i in (3, 2, 1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], size=lat[i - 1].shape[-2:])
        size = lat[0].shape[-2:]
        fuse = torch.cat([F.interpolate(p(l), size=size) for p, l in zip(self.ps, lat)], 1)
        return self.binarize(fuse)  # logits, B x 1 x H x W


def det_loss(logit, gt, mask):
    logit = logit.squeeze(1)
    prob = torch.sigmoid(logit)
    bce = F.binary_cross_entropy_with_logits(logit, gt, reduction="none")
    pos = gt * mask
    neg = (1 - gt) * mask
    n_pos = pos.sum()
    n_neg = torch.minimum(neg.sum(), n_pos * 3).long().clamp(min=1)
    hard_neg = (bce * neg).flatten().topk(int(n_neg)).values
    l_bce = ((bce * pos).sum() + hard_neg.sum()) / (n_pos + n_neg + 1e-6)
    dice = 1 - 2 * (prob * pos).sum() / ((prob * mask).sum() + pos.sum() + 1e-6)
    return l_bce + dice


def unclip(box, ratio=1.5):
    poly = Polygon(box)
    d = poly.area * ratio / max(poly.length, 1e-6)
    off = pyclipper.PyclipperOffset()
    off.AddPath(box.astype(np.int64).tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    out = off.Execute(d)
    return np.array(out[0]) if out else box


def postprocess(prob, scale, thresh=0.3, box_thresh=0.6):
    bitmap = (prob > thresh).astype(np.uint8)
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    polys = []
    for c in contours[:1000]:
        if cv2.contourArea(c) < 16:
            continue
        m = np.zeros_like(bitmap)
        cv2.fillPoly(m, [c], 1)
        if prob[m.astype(bool)].mean() < box_thresh:
            continue
        box = cv2.boxPoints(cv2.minAreaRect(unclip(c.reshape(-1, 2).astype(np.float32))))
        polys.append(box / scale)
    return polys


class DetMetric:
    def __init__(self, iou_thr=0.5):
        self.iou_thr = iou_thr
        self.tp = self.n_pred = self.n_gt = 0

    def update(self, preds, gts, ignore):
        gts = [Polygon(g) for g, ig in zip(gts, ignore) if not ig]
        matched = set()
        for p in preds:
            pp = Polygon(p)
            if not pp.is_valid:
                continue
            for j, g in enumerate(gts):
                if j in matched or not g.is_valid:
                    continue
                inter = pp.intersection(g).area
                if inter / max(pp.union(g).area, 1e-6) >= self.iou_thr:
                    matched.add(j)
                    break
        self.tp += len(matched)
        self.n_pred += len(preds)
        self.n_gt += len(gts)

    def result(self):
        p = self.tp / max(self.n_pred, 1)
        r = self.tp / max(self.n_gt, 1)
        return {"precision": p, "recall": r, "hmean": 2 * p * r / max(p + r, 1e-8)}


@torch.no_grad()
def evaluate(model, loader, dataset, device):
    model.eval()
    metric = DetMetric()
    for x, idxs, scales in loader:
        probs = torch.sigmoid(model(x.to(device))).squeeze(1).cpu().numpy()
        for prob, i, r in zip(probs, idxs, scales):
            _, gts, ignore = dataset.samples[i]
            metric.update(postprocess(prob, r), gts, ignore)
    model.train()
    return metric.result()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    train_ds = DetDataset(args.data_dir, args.train_label, args.size, train=True)
    test_ds = DetDataset(args.data_dir, args.test_label, args.size, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=1, sampler=test_sampler, num_workers=4, collate_fn=test_collate)

    model = DBMobile()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=5e-5)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total,
                                                    pct_start=0.02, anneal_strategy="cos")

    best = {"hmean": 0.0}
    os.makedirs(args.output, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for it, (x, gt, mask) in enumerate(train_loader):
            x, gt, mask = x.to(device, non_blocking=True), gt.to(device), mask.to(device)
            loss = det_loss(model(x), gt, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}/{args.epochs}][{it}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        if epoch >= args.eval_start and (epoch - args.eval_start) % args.eval_step == 0:
            res = evaluate(model.module, test_loader, test_ds, device)
            if rank == 0:
                print(f"epoch {epoch} eval: P {res['precision']:.4f} R {res['recall']:.4f} "
                      f"H {res['hmean']:.4f} (epoch time {time.time() - tic:.0f}s)", flush=True)
                if res["hmean"] > best["hmean"]:
                    best = dict(res, epoch=epoch)
                    torch.save(model.module.state_dict(), os.path.join(args.output, "best_accuracy.pth"))
                    with open(os.path.join(args.output, "best.json"), "w") as f:
                        json.dump(best, f, indent=2)
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.output, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
