# -*- coding: utf-8 -*-
# RRDBNet (ESRGAN 生成器) PSNR 预训练, x4 超分, DF2K 数据
# torchrun --nproc_per_node=8 train_rrdb_psnr.py -opt options/train_RRDB_PSNR_x4.yml
import os
import math
import glob
import time
import random
import logging
import argparse

import cv2
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

logger = logging.getLogger("basicsr")


# ---------------------------- 网络 ----------------------------
class ResidualDenseBlock(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(nf + i * gc, gc if i < 4 else nf, 3, 1, 1) for i in range(5)])
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feats = [x]
        for i, conv in enumerate(self.convs):
            out = conv(torch.cat(feats, 1))
            if i < 4:
                out = self.lrelu(out)
                feats.append(out)
        return out * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf, gc=32):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = ResidualDenseBlock(nf, gc), ResidualDenseBlock(nf, gc), ResidualDenseBlock(nf, gc)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23, scale=4):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.ups = nn.ModuleList([nn.Conv2d(nf, nf, 3, 1, 1) for _ in range(int(math.log2(scale)))])
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        for up in self.ups:
            feat = self.lrelu(up(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


# ---------------------------- 数据 ----------------------------
class PairedImageDataset(Dataset):
    def __init__(self, hr_dir, lr_dir, scale=4, gt_size=128, train=True):
        self.hr_paths = sorted(glob.glob(os.path.join(hr_dir, "*.png")))
        self.lr_dir, self.scale, self.gt_size, self.train = lr_dir, scale, gt_size, train

    def __len__(self):
        return len(self.hr_paths)

    def __getitem__(self, idx):
        hr_path = self.hr_paths[idx]
        name = os.path.splitext(os.path.basename(hr_path))[0]
        lr_path = os.path.join(self.lr_dir, "{}x{}.png".format(name, self.scale))
        hr = cv2.imread(hr_path, cv2.IMREAD_COLOR).astype(np.float32) / 255.0
        lr = cv2.imread(lr_path, cv2.IMREAD_COLOR).astype(np.float32) / 255.0
        if self.train:
            ls = self.gt_size // self.scale
            h, w = lr.shape[:2]
            y, x = random.randint(0, h - ls), random.randint(0, w - ls)
            lr = lr[y:y + ls, x:x + ls]
            hr = hr[y * self.scale:(y + ls) * self.scale, x * self.scale:(x + ls) * self.scale]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        lr = torch.from_numpy(np.ascontiguousarray(lr[:, :, ::-1].transpose(2, 0, 1)))
        hr = torch.from_numpy(np.ascontiguousarray(hr[:, :, ::-1].transpose(2, 0, 1)))
        return lr, hr


def calc_psnr(sr, hr, crop=4):
    sr = sr[..., crop:-crop, crop:-crop].clamp(0, 1)
    hr = hr[..., crop:-crop, crop:-crop]
    mse = F.mse_loss((sr * 255).round(), hr * 255)
    return 10 * torch.log10(255.0 ** 2 / mse).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-opt", default="options/train_RRDB_PSNR_x4.yml")
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = EasyDict(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s: %(message)s")
    logger.info("训练配置: %s", opt)
    seed = opt.get("seed", 0)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)

    train_set = PairedImageDataset(opt.datasets.train.hr, opt.datasets.train.lr, opt.scale, opt.gt_size, True)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=opt.batch_size_per_gpu, sampler=sampler,
                        num_workers=opt.num_worker_per_gpu, pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = PairedImageDataset(opt.datasets.val.hr, opt.datasets.val.lr, opt.scale, train=False)

    net = RRDBNet(nf=64, nb=23, scale=opt.scale).to(device)
    model = DDP(net, device_ids=[local_rank])
    # opt.lr=2e-4 是按 8 卡 x 16 = 128 的总 batch 设的, 卡数不同时线性缩放
    total_batch = opt.batch_size_per_gpu * world_size
    optimizer = torch.optim.Adam(model.parameters(), lr=opt.lr * total_batch / 128, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=opt.milestones, gamma=0.5)
    criterion = nn.L1Loss()

    if rank == 0:
        os.makedirs(opt.save_dir, exist_ok=True)
    step, epoch = 0, 0
    best_psnr = 0.0
    t0 = time.time()
    while step < opt.total_iter:
        sampler.set_epoch(epoch)
        for lr_img, hr_img in loader:
            lr_img = lr_img.to(device, non_blocking=True)
            hr_img = hr_img.to(device, non_blocking=True)
            sr = model(lr_img)
            loss = criterion(sr, hr_img)
            # loss 异常 (数据坏图 / 数值爆炸) 时跳过这个 batch
            if not torch.isfinite(loss) or loss.item() > opt.get("skip_loss_thresh", 1.0):
                logger.warning("rank %d step %d loss 异常 %.4f, 跳过", rank, step, loss.item())
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1

            if step % opt.print_freq == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                logger.info("iter %d l1 %.5f lr %.2e %.3fs/it", step, l.item() / world_size,
                            scheduler.get_last_lr()[0], (time.time() - t0) / opt.print_freq)
                t0 = time.time()

            if step % opt.val_freq == 0:
                if rank == 0:
                    net.eval()
                    psnrs = []
                    with torch.no_grad():
                        for i in range(len(val_set)):
                            lr_v, hr_v = val_set[i]
                            sr_v = net(lr_v[None].to(device))
                            psnrs.append(calc_psnr(sr_v, hr_v[None].to(device), crop=opt.scale))
                    psnr = float(np.mean(psnrs))
                    logger.info("iter %d 验证集 PSNR: %.2f dB", step, psnr)
                    torch.save({"params": net.state_dict(), "iter": step},
                               os.path.join(opt.save_dir, "net_g_latest.pth"))
                    if psnr > best_psnr:
                        best_psnr = psnr
                        torch.save({"params": net.state_dict(), "iter": step},
                                   os.path.join(opt.save_dir, "net_g_best.pth"))
                    net.train()
                dist.barrier()
            if step >= opt.total_iter:
                break
        epoch += 1

    logger.info("训练结束, best PSNR %.2f", best_psnr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
