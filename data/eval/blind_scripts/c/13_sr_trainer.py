# -*- coding: utf-8 -*-
"""
超分辨率训练框架 (Trainer 类), 模型为 SRResNet / EDSR-baseline
    torchrun --nproc_per_node=4 main.py --config configs/edsr_baseline_x2.yaml
"""
import os
import glob
import math
import time
import random
import logging
import argparse

import yaml
import numpy as np
from PIL import Image
from easydict import EasyDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


# ============================== 模型 ==============================
class ResBlock(nn.Module):
    def __init__(self, nf, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(nf, nf, 3, 1, 1), nn.ReLU(True), nn.Conv2d(nf, nf, 3, 1, 1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, scale=2, nf=64, nb=16, res_scale=1.0):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[ResBlock(nf, res_scale) for _ in range(nb)], nn.Conv2d(nf, nf, 3, 1, 1))
        ups = []
        for _ in range(int(math.log2(scale))):
            ups += [nn.Conv2d(nf, nf * 4, 3, 1, 1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*ups, nn.Conv2d(nf, 3, 3, 1, 1))

    def forward(self, x):
        x = x - self.mean
        h = self.head(x)
        h = h + self.body(h)
        return self.tail(h) + self.mean


# ============================== 数据 ==============================
class SRDataset(Dataset):
    def __init__(self, hr_dir, scale, patch=96, train=True, repeat=1):
        self.hr = sorted(glob.glob(os.path.join(hr_dir, "*.png")))
        self.scale, self.patch, self.train, self.repeat = scale, patch, train, repeat

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, idx):
        hr = Image.open(self.hr[idx % len(self.hr)]).convert("RGB")
        w, h = hr.size
        if self.train:
            x, y = random.randint(0, w - self.patch), random.randint(0, h - self.patch)
            hr = hr.crop((x, y, x + self.patch, y + self.patch))
            if random.random() < 0.5:
                hr = hr.transpose(Image.FLIP_LEFT_RIGHT)
            if random.random() < 0.5:
                hr = hr.transpose(Image.ROTATE_90)
        else:
            hr = hr.crop((0, 0, w - w % self.scale, h - h % self.scale))
        lr = hr.resize((hr.size[0] // self.scale, hr.size[1] // self.scale), Image.BICUBIC)
        to_t = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255.0)
        return to_t(lr), to_t(hr)


def psnr_y(sr, hr, shave):
    """Y 通道 PSNR"""
    diff = (sr.clamp(0, 1) - hr) * torch.tensor([65.738, 129.057, 25.064], device=sr.device).view(1, 3, 1, 1) / 256
    diff = diff.sum(1)[..., shave:-shave, shave:-shave]
    return -10 * math.log10(diff.pow(2).mean().item() + 1e-10)


# ============================== Trainer ==============================
class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self._init_dist()
        self._init_logger()
        self._build_data()
        self._build_model()
        self.start_epoch, self.best_psnr = 0, 0.0
        if cfg.resume:
            self.load_checkpoint(cfg.resume)

    def _init_dist(self):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl", init_method="env://")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        seed = self.cfg.seed + self.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _init_logger(self):
        self.logger = logging.getLogger("SR")
        self.logger.setLevel(logging.INFO if self.rank == 0 else logging.ERROR)
        self.logger.addHandler(logging.StreamHandler())
        self.writer = None
        if self.rank == 0:
            os.makedirs(self.cfg.exp_dir, exist_ok=True)
            self.logger.addHandler(logging.FileHandler(os.path.join(self.cfg.exp_dir, "train.log")))
            self.writer = SummaryWriter(os.path.join(self.cfg.exp_dir, "tb"))

    def _build_data(self):
        c = self.cfg
        train_set = SRDataset(c.train_hr, c.scale, c.patch_size, train=True, repeat=c.repeat)
        self.train_sampler = DistributedSampler(train_set, shuffle=True)
        self.train_loader = DataLoader(train_set, batch_size=c.batch_size // self.world_size,
                                       sampler=self.train_sampler, num_workers=c.workers,
                                       pin_memory=True, drop_last=True)
        val_set = SRDataset(c.val_hr, c.scale, train=False)
        # 验证集按 rank 均分 (不补齐), 结果最后再 all_reduce
        self.val_set = Subset(val_set, list(range(self.rank, len(val_set), self.world_size)))

    def _build_model(self):
        c = self.cfg
        model = EDSR(c.scale, c.n_feats, c.n_resblocks, c.res_scale).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank], output_device=self.local_rank)
        # batch_size 是总 batch (所有卡加起来), 所以 lr 不随卡数变化
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=c.lr, betas=(0.9, 0.999))
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(self.optimizer, c.milestones, gamma=0.5)
        self.criterion = nn.L1Loss()

    def load_checkpoint(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.model.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.start_epoch, self.best_psnr = ckpt["epoch"] + 1, ckpt["best_psnr"]
        self.logger.info("resume from %s (epoch %d)", path, self.start_epoch)

    def save_checkpoint(self, epoch, is_best):
        if self.rank != 0:
            return
        ckpt = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "epoch": epoch, "best_psnr": self.best_psnr}
        torch.save(ckpt, os.path.join(self.cfg.exp_dir, "model_latest.pt"))
        if is_best:
            torch.save(ckpt["model"], os.path.join(self.cfg.exp_dir, "model_best.pt"))

    def train_one_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        loss_sum = torch.zeros(2, device=self.device)
        t0 = time.time()
        for it, (lr, hr) in enumerate(self.train_loader):
            lr, hr = lr.to(self.device, non_blocking=True), hr.to(self.device, non_blocking=True)
            loss = self.criterion(self.model(lr), hr)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            if it % self.cfg.print_every == 0:
                self.logger.info("[Epoch %d %d/%d] L1 %.4f %.1fs", epoch, it, len(self.train_loader),
                                 loss.item(), time.time() - t0)
        self.scheduler.step()
        dist.all_reduce(loss_sum)
        return (loss_sum[0] / loss_sum[1]).item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        stat = torch.zeros(2, device=self.device, dtype=torch.float64)
        for i in range(len(self.val_set)):
            lr, hr = self.val_set[i]
            sr = net(lr[None].to(self.device))
            stat[0] += psnr_y(sr, hr[None].to(self.device), self.cfg.scale)
            stat[1] += 1
        dist.all_reduce(stat)
        net.train()
        return (stat[0] / stat[1]).item()

    def fit(self):
        for epoch in range(self.start_epoch, self.cfg.epochs):
            train_loss = self.train_one_epoch(epoch)
            psnr = self.validate()
            is_best = psnr > self.best_psnr
            self.best_psnr = max(psnr, self.best_psnr)
            self.logger.info("Epoch %d: loss %.4f, val PSNR %.3f (best %.3f)", epoch, train_loss, psnr, self.best_psnr)
            if self.writer is not None:
                self.writer.add_scalar("loss", train_loss, epoch)
                self.writer.add_scalar("psnr", psnr, epoch)
            self.save_checkpoint(epoch, is_best)
        if self.writer is not None:
            self.writer.close()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="SR trainer")
    parser.add_argument("--config", default="configs/edsr_baseline_x2.yaml")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = EasyDict(yaml.safe_load(f))
    cfg.resume = args.resume
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
