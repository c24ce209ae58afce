# -*- coding: utf-8 -*-
"""
2D U-Net 医学图像分割 (肝脏 / 肿瘤 CT 切片), Trainer 封装
    torchrun --nproc_per_node=4 train_unet.py --config configs/lits_unet.yaml [--resume ckpt/last.pth]
"""
import os
import glob
import time
import random
import logging
import argparse

import yaml
import numpy as np
from easydict import EasyDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP


# ====================== 网络 ======================
def double_conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, in_ch=1, num_classes=3, base=32):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8, base * 16]
        self.downs = nn.ModuleList([double_conv(in_ch, chs[0])] +
                                   [double_conv(chs[i], chs[i + 1]) for i in range(4)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, 2) for i in reversed(range(4))])
        self.up_convs = nn.ModuleList([double_conv(chs[i] * 2, chs[i]) for i in reversed(range(4))])
        self.out = nn.Conv2d(chs[0], num_classes, 1)

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.downs):
            x = d(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, conv in zip(self.ups, self.up_convs):
            x = conv(torch.cat([up(x), skips.pop()], 1))
        return self.out(x)


# ====================== 数据 ======================
class CTSliceDataset(Dataset):
    """预处理好的 npz: image (H, W) 已做窗宽窗位归一化, label (H, W) 0背景 1肝 2肿瘤"""

    def __init__(self, root, split, train=True, size=256):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.train, self.size = train, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        d = np.load(self.files[idx])
        img, lab = d["image"].astype(np.float32), d["label"].astype(np.int64)
        img = torch.from_numpy(img)[None, None]
        lab = torch.from_numpy(lab)[None, None].float()
        img = F.interpolate(img, size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        lab = F.interpolate(lab, size=(self.size, self.size), mode="nearest")[0, 0].long()
        if self.train:
            if random.random() < 0.5:
                img, lab = img.flip(-1), lab.flip(-1)
            k = random.randint(0, 3)
            img, lab = torch.rot90(img, k, (-2, -1)), torch.rot90(lab, k, (-2, -1))
        return img, lab


def dice_loss(logits, target, eps=1e-5):
    prob = logits.softmax(1)
    onehot = F.one_hot(target, logits.shape[1]).permute(0, 3, 1, 2).float()
    inter = (prob * onehot).sum((0, 2, 3))
    union = prob.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    return 1 - ((2 * inter + eps) / (union + eps))[1:].mean()


# ====================== Trainer ======================
class Trainer:
    def __init__(self, cfg, resume=""):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.logger = self._get_logger()
        random.seed(cfg.seed + self.rank)
        np.random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed + self.rank)

        train_set = CTSliceDataset(cfg.data_root, "train", True, cfg.size)
        val_set = CTSliceDataset(cfg.data_root, "val", False, cfg.size)
        self.train_sampler = DistributedSampler(train_set, shuffle=True)
        self.train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=self.train_sampler,
                                       num_workers=cfg.workers, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(val_set, batch_size=cfg.batch_size,
                                     sampler=DistributedSampler(val_set, shuffle=False), num_workers=cfg.workers)

        model = UNet(1, cfg.num_classes, cfg.base_ch)
        self.start_epoch, self.best_dice = 0, 0.0
        ckpt = None
        if resume:
            ckpt = torch.load(resume, map_location="cpu")
            model.load_state_dict(ckpt["state_dict"])
            self.start_epoch, self.best_dice = ckpt["epoch"] + 1, ckpt["best_dice"]
            self.logger.info("=> 从 %s 恢复, epoch %d", resume, self.start_epoch)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])

        lr = cfg.lr * cfg.batch_size * self.world_size / cfg.ref_batch  # 线性缩放
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=1e-4)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=cfg.epochs, eta_min=1e-6)
        if ckpt is not None:
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.scheduler.load_state_dict(ckpt["scheduler"])

    def _get_logger(self):
        logger = logging.getLogger("unet")
        logger.setLevel(logging.INFO if self.rank == 0 else logging.ERROR)
        if self.rank == 0:
            os.makedirs(self.cfg.save_dir, exist_ok=True)
            for h in (logging.StreamHandler(), logging.FileHandler(os.path.join(self.cfg.save_dir, "train.log"))):
                h.setFormatter(logging.Formatter("%(asctime)s - %(message)s"))
                logger.addHandler(h)
        return logger

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        meter = torch.zeros(2, device=self.device)
        tic = time.time()
        for i, (img, lab) in enumerate(self.train_loader):
            img, lab = img.to(self.device, non_blocking=True), lab.to(self.device, non_blocking=True)
            logits = self.model(img)
            loss = F.cross_entropy(logits, lab) + dice_loss(logits, lab)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            if i % self.cfg.log_interval == 0:
                self.logger.info("Epoch %d [%d/%d] loss %.4f lr %.2e %.1fs", epoch, i, len(self.train_loader),
                                 loss.item(), self.optimizer.param_groups[0]["lr"], time.time() - tic)
        self.scheduler.step()
        dist.all_reduce(meter)
        return (meter[0] / meter[1]).item()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        n = self.cfg.num_classes
        stat = torch.zeros(2, n, device=self.device)  # 每类交集, 每类 pred+gt
        for img, lab in self.val_loader:
            pred = self.model(img.to(self.device)).argmax(1)
            lab = lab.to(self.device)
            for c in range(1, n):
                stat[0, c] += ((pred == c) & (lab == c)).sum()
                stat[1, c] += (pred == c).sum() + (lab == c).sum()
        dist.all_reduce(stat)
        dice = (2 * stat[0, 1:] / stat[1, 1:].clamp(min=1)).cpu().numpy()
        self.model.train()
        return dice

    def save_checkpoint(self, epoch, is_best):
        if self.rank != 0:
            return
        state = {"state_dict": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "epoch": epoch, "best_dice": self.best_dice}
        torch.save(state, os.path.join(self.cfg.save_dir, "last.pth"))
        if is_best:
            torch.save(state, os.path.join(self.cfg.save_dir, "best.pth"))

    def run(self):
        for epoch in range(self.start_epoch, self.cfg.epochs):
            loss = self.train_epoch(epoch)
            dice = self.validate()
            mean_dice = float(dice.mean())
            is_best = mean_dice > self.best_dice
            self.best_dice = max(self.best_dice, mean_dice)
            self.logger.info("Epoch %d 平均loss %.4f | Dice 肝脏 %.4f 肿瘤 %.4f | best %.4f",
                             epoch, loss, dice[0], dice[-1], self.best_dice)
            self.save_checkpoint(epoch, is_best)
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/lits_unet.yaml")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = EasyDict(yaml.safe_load(f))
    Trainer(cfg, args.resume).run()


if __name__ == "__main__":
    main()
