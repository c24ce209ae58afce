# -*- coding: utf-8 -*-
"""
文本检测 DBNet 分布式训练（ResNet18 + FPN）

训练数据为离线生成好的 shrink map / threshold map（tools/make_db_gt.py），每个样本一个 npz：
    image: HxWx3 uint8, gt: HxW, mask: HxW, thresh_map: HxW, thresh_mask: HxW
启动：
    torchrun --nproc_per_node=8 05_dbnet_text_det.py -c configs/det_r18_db.yaml
"""
import os
import glob
import time
import random
import argparse
import logging

import yaml
import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("det")
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class DBDataset(Dataset):
    def __init__(self, data_dir, img_size=640, is_train=True):
        self.files = sorted(glob.glob(os.path.join(data_dir, "*.npz")))
        self.img_size = img_size
        self.is_train = is_train

    def __len__(self):
        return len(self.files)

    def _random_crop(self, arrays):
        h, w = arrays[0].shape[:2]
        s = self.img_size
        scale = s / max(h, w) * random.uniform(0.7, 1.3) if self.is_train else s / max(h, w)
        arrays = [cv2.resize(a, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR if i == 0 else cv2.INTER_NEAREST)
                  for i, a in enumerate(arrays)]
        h, w = arrays[0].shape[:2]
        y0 = random.randint(0, max(0, h - s)) if self.is_train else 0
        x0 = random.randint(0, max(0, w - s)) if self.is_train else 0
        out = []
        for a in arrays:
            pad = np.zeros((s, s) + a.shape[2:], dtype=a.dtype)
            crop = a[y0:y0 + s, x0:x0 + s]
            pad[:crop.shape[0], :crop.shape[1]] = crop
            out.append(pad)
        return out

    def __getitem__(self, idx):
        d = np.load(self.files[idx])
        img, gt, mask, tmap, tmask = self._random_crop(
            [d["image"], d["gt"].astype(np.float32), d["mask"].astype(np.float32),
             d["thresh_map"].astype(np.float32), d["thresh_mask"].astype(np.float32)])
        img = (img.astype(np.float32) / 255.0 - MEAN) / STD
        return {
            "image": torch.from_numpy(img.transpose(2, 0, 1)),
            "gt": torch.from_numpy(gt), "mask": torch.from_numpy(mask),
            "thresh_map": torch.from_numpy(tmap), "thresh_mask": torch.from_numpy(tmask),
        }


class FPN(nn.Module):
    def __init__(self, in_channels, inner=256):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(c, inner, 1, bias=False) for c in in_channels])
        self.smooth = nn.ModuleList([nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False) for _ in in_channels])

    def forward(self, feats):
        lat = [l(f) for l, f in zip(self.lateral, feats)]
        for i in range(len(lat) - 1, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], size=lat[i - 1].shape[-2:], mode="nearest")
        outs = [s(x) for s, x in zip(self.smooth, lat)]
        size = outs[0].shape[-2:]
        outs = [outs[0]] + [F.interpolate(o, size=size, mode="nearest") for o in outs[1:]]
        return torch.cat(outs, dim=1)


class DBHead(nn.Module):
    def __init__(self, in_ch=256, k=50):
        super().__init__()
        self.k = k

        def branch():
            return nn.Sequential(
                nn.Conv2d(in_ch, in_ch // 4, 3, padding=1, bias=False), nn.BatchNorm2d(in_ch // 4), nn.ReLU(inplace=True),
                nn.ConvTranspose2d(in_ch // 4, in_ch // 4, 2, 2), nn.BatchNorm2d(in_ch // 4), nn.ReLU(inplace=True),
                nn.ConvTranspose2d(in_ch // 4, 1, 2, 2), nn.Sigmoid())

        self.binarize = branch()
        self.thresh = branch()

    def forward(self, x):
        prob = self.binarize(x)
        if not self.training:
            return {"prob": prob}
        thr = self.thresh(x)
        binary = torch.reciprocal(1 + torch.exp(-self.k * (prob - thr)))
        return {"prob": prob, "thresh": thr, "binary": binary}


class DBNet(nn.Module):
    def __init__(self, pretrained=True):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1" if pretrained else None)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.neck = FPN([64, 128, 256, 512])
        self.head = DBHead(256)

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return self.head(self.neck(feats))


def dice_loss(pred, gt, mask, eps=1e-6):
    inter = (pred * gt * mask).sum()
    union = (pred * mask).sum() + (gt * mask).sum() + eps
    return 1 - 2.0 * inter / union


def balanced_bce(pred, gt, mask, ratio=3.0):
    pos = (gt * mask).bool()
    neg = ((1 - gt) * mask).bool()
    pos_cnt = int(pos.sum())
    neg_cnt = min(int(neg.sum()), int(pos_cnt * ratio))
    loss = F.binary_cross_entropy(pred, gt, reduction="none")
    pos_loss = loss[pos]
    neg_loss, _ = loss[neg].topk(neg_cnt) if neg_cnt > 0 else (loss.new_zeros(0), None)
    return (pos_loss.sum() + neg_loss.sum()) / (pos_cnt + neg_cnt + 1e-6)


def db_loss(out, batch):
    prob, thr, binary = out["prob"].squeeze(1), out["thresh"].squeeze(1), out["binary"].squeeze(1)
    l_prob = balanced_bce(prob, batch["gt"], batch["mask"])
    l_thr = (torch.abs(thr - batch["thresh_map"]) * batch["thresh_mask"]).sum() / (batch["thresh_mask"].sum() + 1e-6)
    l_bin = dice_loss(binary, batch["gt"], batch["mask"])
    return l_prob + 10.0 * l_thr + l_bin, {"prob": l_prob.item(), "thr": l_thr.item(), "bin": l_bin.item()}


@torch.no_grad()
def evaluate(model, loader, device, thresh=0.3):
    """像素级 P/R/F，作为训练过程中的快速指标；正式 hmean 用 tools/eval_det.py 离线算"""
    model.eval()
    stat = torch.zeros(3, device=device)  # tp, pred_pos, gt_pos
    for batch in loader:
        img = batch["image"].to(device, non_blocking=True)
        gt = (batch["gt"] * batch["mask"]).to(device)
        pred = (model.module(img)["prob"].squeeze(1) > thresh).float() * batch["mask"].to(device)
        stat[0] += (pred * gt).sum()
        stat[1] += pred.sum()
        stat[2] += gt.sum()
    dist.all_reduce(stat)
    model.train()
    p = (stat[0] / stat[1].clamp(min=1)).item()
    r = (stat[0] / stat[2].clamp(min=1)).item()
    return p, r, 2 * p * r / max(p + r, 1e-6)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", required=True)
    args = parser.parse_args()
    with open(args.config, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    out_dir = cfg["Global"]["save_model_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    train_set = DBDataset(cfg["Train"]["data_dir"], cfg["Train"]["img_size"], True)
    eval_set = DBDataset(cfg["Eval"]["data_dir"], cfg["Train"]["img_size"], False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    bs = cfg["Train"]["batch_size_per_card"]  # 640x640 下单卡 4 张
    train_loader = DataLoader(train_set, batch_size=bs, sampler=train_sampler,
                              num_workers=cfg["Train"]["num_workers"], pin_memory=True, drop_last=True)
    # 验证集按 rank 切片，不补齐重复样本
    eval_loader = DataLoader(Subset(eval_set, range(rank, len(eval_set), world_size)), batch_size=1, num_workers=2)

    model = DBNet(pretrained=True).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    epochs = cfg["Global"]["epoch_num"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["Optimizer"]["lr"], weight_decay=1e-4)
    max_iter = epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / max_iter) ** 0.9)

    start_epoch, best_f = 0, 0.0
    last_path = os.path.join(out_dir, "latest.pth")
    if cfg["Global"].get("resume", False) and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_f = ckpt["epoch"] + 1, ckpt["best_f"]
        logger.info("断点续训: epoch %d, best_f %.4f", start_epoch, best_f)

    for epoch in range(start_epoch, epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(batch["image"])
            loss, parts = db_loss(out, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % cfg["Global"]["print_batch_step"] == 0:
                logger.info("epoch [%d/%d] iter [%d/%d] loss %.4f prob %.4f thr %.4f bin %.4f lr %.6f time %.2fs",
                            epoch, epochs, it, len(train_loader), loss.item(), parts["prob"], parts["thr"],
                            parts["bin"], scheduler.get_last_lr()[0], time.time() - t0)
                t0 = time.time()

        if (epoch + 1) % cfg["Global"]["eval_epoch_step"] == 0:
            p, r, f = evaluate(model, eval_loader, device)
            logger.info("eval epoch %d: precision %.4f recall %.4f f %.4f", epoch, p, r, f)
            if rank == 0 and f > best_f:
                best_f = f
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best_accuracy.pth"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f": best_f}, last_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
