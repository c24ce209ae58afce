# -*- coding: utf-8 -*-
"""
简化版 DBNet 文本检测 (ResNet18-FPN, 概率图 + 可微二值化), ICDAR2015 / 自有票据数据
    torchrun --nproc_per_node=4 train_db.py --config configs/db_r18_icdar15.yaml
"""
import os
import glob
import time
import pickle
import random
import argparse

import cv2
import yaml
import numpy as np
import pyclipper
from easydict import EasyDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision


# ----------------------------- 数据 -----------------------------
def parse_icdar_gt(gt_path):
    polys, ignores = [], []
    with open(gt_path, encoding="utf-8-sig") as f:
        for line in f:
            parts = line.strip().split(",")
            if len(parts) < 9:
                continue
            pts = np.array(list(map(float, parts[:8]))).reshape(4, 2)
            text = ",".join(parts[8:])
            polys.append(pts)
            ignores.append(text in ("###", "*"))
    return polys, ignores


class TextDetDataset(Dataset):
    def __init__(self, data_dir, split, img_size=640, train=True, shrink_ratio=0.4):
        self.img_size, self.train, self.shrink_ratio = img_size, train, shrink_ratio
        cache_file = os.path.join(data_dir, "{}_cache.pkl".format(split))
        if os.path.exists(cache_file):
            with open(cache_file, "rb") as f:
                self.items = pickle.load(f)
        else:
            # 第一次运行: 解析所有 gt 文件并缓存, 下次直接读
            self.items = []
            for img_path in sorted(glob.glob(os.path.join(data_dir, split, "images", "*.jpg"))):
                name = os.path.splitext(os.path.basename(img_path))[0]
                gt_path = os.path.join(data_dir, split, "gts", "gt_" + name + ".txt")
                polys, ignores = parse_icdar_gt(gt_path)
                self.items.append({"img": img_path, "polys": polys, "ignores": ignores})
            with open(cache_file, "wb") as f:
                pickle.dump(self.items, f)

    def __len__(self):
        return len(self.items)

    def _shrink(self, poly):
        area = cv2.contourArea(poly.astype(np.float32))
        peri = cv2.arcLength(poly.astype(np.float32), True)
        d = area * (1 - self.shrink_ratio ** 2) / max(peri, 1e-6)
        pco = pyclipper.PyclipperOffset()
        pco.AddPath(poly.astype(np.int64).tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
        out = pco.Execute(-d)
        return np.array(out[0]) if out else None

    def __getitem__(self, idx):
        item = self.items[idx]
        img = cv2.imread(item["img"])
        h, w = img.shape[:2]
        s = self.img_size / max(h, w)
        img = cv2.resize(img, (int(w * s), int(h * s)))
        polys = [p * s for p in item["polys"]]
        canvas = np.zeros((self.img_size, self.img_size, 3), dtype=np.uint8)
        canvas[:img.shape[0], :img.shape[1]] = img
        gt = np.zeros((self.img_size, self.img_size), dtype=np.float32)
        mask = np.ones((self.img_size, self.img_size), dtype=np.float32)
        for poly, ign in zip(polys, item["ignores"]):
            shrunk = None if ign else self._shrink(poly)
            if shrunk is None or len(shrunk) < 3:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
            else:
                cv2.fillPoly(gt, [shrunk.astype(np.int32)], 1)
        if self.train and random.random() < 0.5:
            canvas, gt, mask = canvas[:, ::-1], gt[:, ::-1], mask[:, ::-1]
        x = (canvas.astype(np.float32) / 255.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
        x = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))).float()
        return x, torch.from_numpy(np.ascontiguousarray(gt)), torch.from_numpy(np.ascontiguousarray(mask)), idx


# ----------------------------- 模型 -----------------------------
class DBNet(nn.Module):
    def __init__(self, k=50):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.lateral = nn.ModuleList([nn.Conv2d(c, 64, 1) for c in (64, 128, 256, 512)])
        self.smooth = nn.ModuleList([nn.Conv2d(64, 16, 3, padding=1) for _ in range(4)])

        def head():
            return nn.Sequential(nn.Conv2d(64, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(True),
                                 nn.ConvTranspose2d(16, 16, 2, 2), nn.BatchNorm2d(16), nn.ReLU(True),
                                 nn.ConvTranspose2d(16, 1, 2, 2), nn.Sigmoid())
        self.prob_head, self.thresh_head, self.k = head(), head(), k

    def forward(self, x):
        feats, h = [], self.stem(x)
        for layer in self.layers:
            h = layer(h)
            feats.append(h)
        p = [l(f) for l, f in zip(self.lateral, feats)]
        for i in range(3, 0, -1):
            p[i - 1] = p[i - 1] + F.interpolate(p[i], size=p[i - 1].shape[-2:], mode="nearest")
        fuse = torch.cat([F.interpolate(s(pi), size=p[0].shape[-2:], mode="nearest")
                          for s, pi in zip(self.smooth, p)], dim=1)
        prob = self.prob_head(fuse)
        if not self.training:
            return prob
        thresh = self.thresh_head(fuse)
        binary = torch.sigmoid(self.k * (prob - thresh))
        return prob, binary


def dice_loss(pred, gt, mask, eps=1e-6):
    inter = (pred * gt * mask).sum()
    return 1 - 2 * inter / ((pred * mask).sum() + (gt * mask).sum() + eps)


def balanced_bce(pred, gt, mask, ratio=3.0):
    pos = (gt * mask).bool()
    neg = ((1 - gt) * mask).bool()
    n_pos = int(pos.sum())
    n_neg = min(int(neg.sum()), int(n_pos * ratio))
    loss = F.binary_cross_entropy(pred.clamp(1e-6, 1 - 1e-6), gt, reduction="none")
    neg_loss, _ = loss[neg].topk(n_neg) if n_neg > 0 else (loss.new_zeros(0), None)
    return (loss[pos].sum() + neg_loss.sum()) / (n_pos + n_neg + 1e-6)


@torch.no_grad()
def evaluate(model, loader, device, thr=0.3):
    """像素级 P/R/F (快速验证用, 正式指标用官方脚本)"""
    model.eval()
    stat = torch.zeros(3, device=device)  # tp, pred_pos, gt_pos
    for x, gt, mask, _ in loader:
        prob = model(x.to(device)).squeeze(1)
        gt, mask = gt.to(device), mask.to(device)
        pred = (prob > thr).float() * mask
        stat += torch.stack([(pred * gt).sum(), pred.sum(), (gt * mask).sum()])
    dist.all_reduce(stat)
    model.train()
    p = (stat[0] / stat[1].clamp(min=1)).item()
    r = (stat[0] / stat[2].clamp(min=1)).item()
    return p, r, 2 * p * r / max(p + r, 1e-6)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/db_r18_icdar15.yaml")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = EasyDict(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    train_set = TextDetDataset(cfg.data_dir, "train", cfg.img_size, train=True)
    test_set = TextDetDataset(cfg.data_dir, "test", cfg.img_size, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=4, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=cfg.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DBNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    # 原论文 lr=0.007 对应总 batch 16
    base_lr = cfg.lr * cfg.batch_size * world_size / 16
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=1e-4)
    max_iter = cfg.epochs * len(train_loader)
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)

    cur, best_f = 0, 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, gt, mask, _ in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = base_lr * (1 - cur / max_iter) ** 0.9
            x, gt, mask = x.to(device), gt.to(device), mask.to(device)
            prob, binary = model(x)
            loss = balanced_bce(prob.squeeze(1), gt, mask) + dice_loss(binary.squeeze(1), gt, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cur += 1
            if rank == 0 and cur % 20 == 0:
                print("epoch %d iter %d loss %.4f lr %.5f %.2fs" % (epoch, cur, loss.item(),
                                                                   optimizer.param_groups[0]["lr"], time.time() - t0))
                t0 = time.time()
        if (epoch + 1) % cfg.eval_interval == 0:
            p, r, f = evaluate(model, test_loader, device)
            if rank == 0:
                print("[eval] epoch %d precision %.4f recall %.4f hmean %.4f" % (epoch, p, r, f))
                torch.save(model.module.state_dict(), os.path.join(cfg.output_dir, "model_latest.pth"))
                if f > best_f:
                    best_f = f
                    torch.save(model.module.state_dict(), os.path.join(cfg.output_dir, "model_best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
