"""DBNet++ style detector (ResNet-50, FPN + ASF) for curved text on Total-Text / CTW1500.

Launch on one 8-GPU node:
    torchrun --nproc_per_node=8 07_dbnet_r50_totaltext.py --root /data/totaltext --size 1024
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, dataclass

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
from torchvision.models import resnet50


@dataclass
class Cfg:
    root: str = "/data/totaltext"
    size: int = 1024
    batch_per_gpu: int = 2
    epochs: int = 600
    lr: float = 0.007
    shrink_ratio: float = 0.4
    thresh_min: float = 0.3
    thresh_max: float = 0.7
    workers: int = 8
    eval_interval: int = 25
    out: str = "work_dirs/dbnetpp_r50_totaltext"


def parse() -> Cfg:
    c = Cfg()
    ap = argparse.ArgumentParser()
    for k, v in asdict(c).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return Cfg(**vars(ap.parse_args()))


def shrink_polygon(poly: np.ndarray, ratio: float) -> np.ndarray | None:
    p = Polygon(poly)
    if p.area < 1:
        return None
    d = p.area * (1 - ratio ** 2) / max(p.length, 1e-6)
    pco = pyclipper.PyclipperOffset()
    pco.AddPath(poly.astype(np.int64).tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    out = pco.Execute(-d)
    return np.array(out[0]) if out else None


class TotalText(Dataset):
    """Annotations: <split>_gts/<img>.txt with 'x1,y1,...,xn,yn,text' per line (### = ignore)."""

    def __init__(self, cfg: Cfg, split: str):
        self.cfg, self.split = cfg, split
        self.img_dir = os.path.join(cfg.root, f"{split}_images")
        self.gt_dir = os.path.join(cfg.root, f"{split}_gts")
        self.files = sorted(os.listdir(self.img_dir))

    def __len__(self):
        return len(self.files)

    def _load_polys(self, name):
        polys, ignore = [], []
        with open(os.path.join(self.gt_dir, os.path.splitext(name)[0] + ".txt"), encoding="utf-8") as f:
            for line in f:
                parts = line.strip().split(",")
                n = (len(parts) - 1) // 2 * 2
                pts = np.array(list(map(float, parts[:n]))).reshape(-1, 2)
                polys.append(pts)
                ignore.append(parts[-1] == "###")
        return polys, ignore

    def __getitem__(self, i):
        name = self.files[i]
        img = cv2.imread(os.path.join(self.img_dir, name))
        polys, ignore = self._load_polys(name)
        h, w = img.shape[:2]
        s = self.cfg.size
        if self.split == "train":
            scale = np.random.uniform(0.5, 1.5) * s / max(h, w)
        else:
            scale = s / max(h, w)
        img = cv2.resize(img, None, fx=scale, fy=scale)
        polys = [p * scale for p in polys]
        pad = np.zeros((s, s, 3), np.uint8)
        hh, ww = min(s, img.shape[0]), min(s, img.shape[1])
        pad[:hh, :ww] = img[:hh, :ww]
        gt = np.zeros((s, s), np.float32)
        mask = np.ones((s, s), np.float32)
        tmap = np.zeros((s, s), np.float32)
        tmask = np.zeros((s, s), np.float32)
        for poly, ig in zip(polys, ignore):
            if ig or len(poly) < 3:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
                continue
            shr = shrink_polygon(poly, self.cfg.shrink_ratio)
            if shr is None:
                cv2.fillPoly(mask, [poly.astype(np.int32)], 0)
                continue
            cv2.fillPoly(gt, [shr.astype(np.int32)], 1)
            cv2.polylines(tmap, [poly.astype(np.int32)], True, 1.0, thickness=6)
            cv2.fillPoly(tmask, [poly.astype(np.int32)], 1)
        tmap = tmap * (self.cfg.thresh_max - self.cfg.thresh_min) + self.cfg.thresh_min
        x = torch.from_numpy(pad[:, :, ::-1].copy()).permute(2, 0, 1).float().div(255)
        x = (x - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        return x, torch.from_numpy(gt), torch.from_numpy(mask), torch.from_numpy(tmap), torch.from_numpy(tmask)


class ASF(nn.Module):
    """Adaptive scale fusion over the 4 FPN levels."""

    def __init__(self, c=256):
        super().__init__()
        self.conv = nn.Conv2d(c, c // 4, 3, padding=1)
        self.spatial = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.ReLU(True), nn.Conv2d(1, 1, 1), nn.Sigmoid())
        self.attn = nn.Sequential(nn.Conv2d(c // 4, 4, 1), nn.Sigmoid())

    def forward(self, fused, feats):
        x = self.conv(fused)
        x = self.spatial(x.mean(1, keepdim=True)) + x
        w = self.attn(x)
        return torch.cat([feats[i] * w[:, i:i + 1] for i in range(4)], 1)


class DBNetPP(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet50(weights="IMAGENET1K_V2")
        self.c1 = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)
        self.c2, self.c3, self.c4 = r.layer2, r.layer3, r.layer4
        self.lat = nn.ModuleList([nn.Conv2d(c, 256, 1) for c in (256, 512, 1024, 2048)])
        self.out = nn.ModuleList([nn.Sequential(nn.Conv2d(256, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                                                nn.ReLU(True)) for _ in range(4)])
        self.asf = ASF(256)

        def head():
            return nn.Sequential(nn.Conv2d(256, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
                                 nn.ConvTranspose2d(64, 64, 2, 2), nn.BatchNorm2d(64), nn.ReLU(True),
                                 nn.ConvTranspose2d(64, 1, 2, 2))
        self.prob_head, self.thr_head = head(), head()

    def forward(self, x):
        f1 = self.c1(x); f2 = self.c2(f1); f3 = self.c3(f2); f4 = self.c4(f3)
        p = [l(f) for l, f in zip(self.lat, (f1, f2, f3, f4))]
        for i in (3, 2, 1):
            p[i - 1] = p[i - 1] + F.interpolate(p[i], size=p[i - 1].shape[-2:], mode="nearest")
        feats = [F.interpolate(o(pi), size=p[0].shape[-2:], mode="nearest") for o, pi in zip(self.out, p)]
        fused = self.asf(torch.cat(feats, 1), feats)
        prob = torch.sigmoid(self.prob_head(fused))
        if not self.training:
            return prob
        thr = torch.sigmoid(self.thr_head(fused))
        return prob, thr, torch.sigmoid(50 * (prob - thr))


def loss_fn(prob, thr, binm, gt, mask, tmap, tmask):
    prob, thr, binm = prob.squeeze(1), thr.squeeze(1), binm.squeeze(1)
    pos = gt * mask
    neg = (1 - gt) * mask
    npos = int(pos.sum().item())
    nneg = min(int(neg.sum().item()), npos * 3)
    bce = F.binary_cross_entropy(prob, gt, reduction="none")
    negl = (bce * neg).view(-1).topk(max(nneg, 1)).values
    l_s = ((bce * pos).sum() + negl.sum()) / (npos + nneg + 1e-6)
    l_t = (torch.abs(thr - tmap) * tmask).sum() / (tmask.sum() + 1e-6)
    l_b = 1 - 2 * (binm * gt * mask).sum() / ((binm * mask).sum() + pos.sum() + 1e-6)
    return l_s + 10 * l_t + l_b


@torch.no_grad()
def pixel_hmean(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, gt, mask, _, _ in loader:
        pred = (net(x.to(device)).squeeze(1) > 0.3).float()
        gt, mask = gt.to(device), mask.to(device)
        s[0] += (pred * gt * mask).sum()
        s[1] += (pred * mask).sum()
        s[2] += (gt * mask).sum()
    dist.all_reduce(s)
    net.train()
    p, r = (s[0] / s[1].clamp(min=1)).item(), (s[0] / s[2].clamp(min=1)).item()
    return 2 * p * r / max(p + r, 1e-6)


def main():
    cfg = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    log = logging.getLogger()
    log.info("cfg: %s", asdict(cfg))

    train = TotalText(cfg, "train")
    test = TotalText(cfg, "test")
    sampler = DistributedSampler(train, shuffle=True)
    train_loader = DataLoader(train, cfg.batch_per_gpu, sampler=sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test, range(rank, len(test), world)), 1, num_workers=2)

    model = DBNetPP().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4)
    max_it = cfg.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / max_it) ** 0.9)

    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for it, (x, gt, mask, tmap, tmask) in enumerate(train_loader):
            x, gt, mask = x.to(device, non_blocking=True), gt.to(device), mask.to(device)
            tmap, tmask = tmap.to(device), tmask.to(device)
            prob, thr, binm = model(x)
            loss = loss_fn(prob, thr, binm, gt, mask, tmap, tmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 20 == 0:
                log.info("ep %d it %d loss %.4f lr %.5f", epoch, it, loss.item(), sched.get_last_lr()[0])
        if (epoch + 1) % cfg.eval_interval == 0:
            h = pixel_hmean(model.module, test_loader, device)
            log.info("ep %d pixel hmean %.4f", epoch, h)
            if rank == 0:
                os.makedirs(cfg.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(cfg.out, "latest.pth"))
                if h > best:
                    best = h
                    torch.save(model.module.state_dict(), os.path.join(cfg.out, "best.pth"))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
