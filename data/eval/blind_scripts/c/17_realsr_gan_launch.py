# -*- coding: utf-8 -*-
"""
Real-ESRGAN 风格的 GAN 微调 (SRVGGNetCompact 生成器 + U-Net 判别器), x4
数据为预先生成好的 LR/HR 对
    python -m torch.distributed.launch --nproc_per_node=4 --master_port=4321 train_realsr.py \
        --opt options/finetune_compact_x4.yml [--resume experiments/xxx/training_state.pth]
"""
import os
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
from torch.nn.utils import spectral_norm
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.models import vgg19


def parse_options():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt", type=str, required=True)
    parser.add_argument("--resume", type=str, default=None, help="training_state 路径")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = EasyDict(yaml.safe_load(f))
    return args, opt


def get_root_logger(rank, log_file=None):
    logger = logging.getLogger("realsr")
    if rank != 0:
        logger.setLevel(logging.ERROR)
        return logger
    logger.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s INFO: %(message)s")
    for h in [logging.StreamHandler()] + ([logging.FileHandler(log_file)] if log_file else []):
        h.setFormatter(fmt)
        logger.addHandler(h)
    return logger


# --------------------------- 网络 ---------------------------
class SRVGGNetCompact(nn.Module):
    def __init__(self, num_feat=64, num_conv=32, upscale=4):
        super().__init__()
        layers = [nn.Conv2d(3, num_feat, 3, 1, 1), nn.PReLU(num_feat)]
        for _ in range(num_conv):
            layers += [nn.Conv2d(num_feat, num_feat, 3, 1, 1), nn.PReLU(num_feat)]
        layers += [nn.Conv2d(num_feat, 3 * upscale * upscale, 3, 1, 1)]
        self.body = nn.Sequential(*layers)
        self.upsampler = nn.PixelShuffle(upscale)
        self.upscale = upscale

    def forward(self, x):
        out = self.upsampler(self.body(x))
        return out + F.interpolate(x, scale_factor=self.upscale, mode="nearest")


class UNetDiscriminatorSN(nn.Module):
    def __init__(self, nf=64):
        super().__init__()
        self.conv0 = nn.Conv2d(3, nf, 3, 1, 1)
        self.conv1 = spectral_norm(nn.Conv2d(nf, nf * 2, 4, 2, 1, bias=False))
        self.conv2 = spectral_norm(nn.Conv2d(nf * 2, nf * 4, 4, 2, 1, bias=False))
        self.conv3 = spectral_norm(nn.Conv2d(nf * 4, nf * 8, 4, 2, 1, bias=False))
        self.conv4 = spectral_norm(nn.Conv2d(nf * 8, nf * 4, 3, 1, 1, bias=False))
        self.conv5 = spectral_norm(nn.Conv2d(nf * 4, nf * 2, 3, 1, 1, bias=False))
        self.conv6 = spectral_norm(nn.Conv2d(nf * 2, nf, 3, 1, 1, bias=False))
        self.conv7 = spectral_norm(nn.Conv2d(nf, nf, 3, 1, 1, bias=False))
        self.conv8 = nn.Conv2d(nf, 1, 3, 1, 1)

    def forward(self, x):
        act = lambda t: F.leaky_relu(t, 0.2, inplace=True)
        up = lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False)
        x0 = act(self.conv0(x))
        x1 = act(self.conv1(x0))
        x2 = act(self.conv2(x1))
        x3 = act(self.conv3(x2))
        x4 = act(self.conv4(up(x3))) + x2
        x5 = act(self.conv5(up(x4))) + x1
        x6 = act(self.conv6(up(x5))) + x0
        return self.conv8(act(self.conv7(x6)))


class PerceptualLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.vgg = vgg19(weights="IMAGENET1K_V1").features[:35].eval().requires_grad_(False)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        return F.l1_loss(self.vgg((x - self.mean) / self.std), self.vgg((gt - self.mean) / self.std))


# --------------------------- 数据 ---------------------------
class PairedDataset(Dataset):
    def __init__(self, gt_dir, lq_dir, gt_size=256, scale=4, train=True):
        self.gt_paths = sorted(glob.glob(os.path.join(gt_dir, "*.png")))
        self.lq_dir, self.gt_size, self.scale, self.train = lq_dir, gt_size, scale, train

    def __len__(self):
        return len(self.gt_paths)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt_paths[i])[:, :, ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(os.path.join(self.lq_dir, os.path.basename(self.gt_paths[i])))[:, :, ::-1]
        lq = lq.astype(np.float32) / 255.0
        if self.train:
            ls = self.gt_size // self.scale
            y, x = random.randint(0, lq.shape[0] - ls), random.randint(0, lq.shape[1] - ls)
            lq = lq[y:y + ls, x:x + ls]
            gt = gt[y * self.scale:(y + ls) * self.scale, x * self.scale:(x + ls) * self.scale]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return to_t(lq), to_t(gt)


def main():
    args, opt = parse_options()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    exp_dir = os.path.join("experiments", opt.name)
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
    dist.barrier()
    logger = get_root_logger(rank, os.path.join(exp_dir, "train.log"))
    random.seed(opt.manual_seed + rank)
    np.random.seed(opt.manual_seed + rank)
    torch.manual_seed(opt.manual_seed + rank)

    train_set = PairedDataset(opt.train.gt_dir, opt.train.lq_dir, opt.gt_size, opt.scale, True)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=opt.batch_size_per_gpu, sampler=sampler,
                        num_workers=opt.num_worker_per_gpu, pin_memory=True, drop_last=True)
    val_set = PairedDataset(opt.val.gt_dir, opt.val.lq_dir, scale=opt.scale, train=False)

    net_g = SRVGGNetCompact(upscale=opt.scale)
    net_g.load_state_dict(torch.load(opt.pretrain_g, map_location="cpu")["params"])
    net_g = DDP(net_g.to(device), device_ids=[args.local_rank])
    net_d = DDP(UNetDiscriminatorSN().to(device), device_ids=[args.local_rank])
    cri_perceptual = PerceptualLoss().to(device)

    opt_g = torch.optim.Adam(net_g.parameters(), lr=opt.lr_g, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=opt.lr_d, betas=(0.9, 0.99))
    sched_g = torch.optim.lr_scheduler.MultiStepLR(opt_g, milestones=opt.milestones, gamma=0.5)
    sched_d = torch.optim.lr_scheduler.MultiStepLR(opt_d, milestones=opt.milestones, gamma=0.5)

    current_iter, start_epoch = 0, 0
    if args.resume:
        state = torch.load(args.resume)
        net_g.module.load_state_dict(state["net_g"])
        net_d.module.load_state_dict(state["net_d"])
        opt_g.load_state_dict(state["opt_g"])
        opt_d.load_state_dict(state["opt_d"])
        sched_g.load_state_dict(state["sched_g"])
        sched_d.load_state_dict(state["sched_d"])
        current_iter, start_epoch = state["iter"], state["epoch"]
        logger.info("Resuming training from epoch: %d, iter: %d.", start_epoch, current_iter)

    epoch = start_epoch
    t0 = time.time()
    while current_iter < opt.total_iter:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            current_iter += 1
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            # ---------- 生成器 ----------
            for p in net_d.parameters():
                p.requires_grad = False
            opt_g.zero_grad()
            out = net_g(lq)
            l_pix = F.l1_loss(out, gt)
            l_percep = cri_perceptual(out, gt)
            l_gan = F.softplus(-net_d(out)).mean()
            l_g = l_pix + l_percep + 0.1 * l_gan
            l_g.backward()
            opt_g.step()
            # ---------- 判别器 ----------
            for p in net_d.parameters():
                p.requires_grad = True
            opt_d.zero_grad()
            l_d_real = F.softplus(-net_d(gt)).mean()
            l_d_fake = F.softplus(net_d(out.detach())).mean()
            (l_d_real + l_d_fake).backward()
            opt_d.step()
            sched_g.step()
            sched_d.step()

            if current_iter % opt.print_freq == 0:
                logs = torch.stack([l_pix, l_percep, l_gan, l_d_real, l_d_fake]).detach()
                dist.all_reduce(logs)
                logs = (logs / world_size).tolist()
                logger.info("[epoch:%3d, iter:%8d, lr:(%.3e)] l_pix: %.4e l_percep: %.4e l_g_gan: %.4e "
                            "l_d_real: %.4e l_d_fake: %.4e time: %.3f", epoch, current_iter,
                            sched_g.get_last_lr()[0], *logs, (time.time() - t0) / opt.print_freq)
                t0 = time.time()
            if current_iter % opt.save_freq == 0 and rank == 0:
                torch.save({"net_g": net_g.module.state_dict(), "net_d": net_d.module.state_dict(),
                            "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                            "sched_g": sched_g.state_dict(), "sched_d": sched_d.state_dict(),
                            "iter": current_iter, "epoch": epoch}, os.path.join(exp_dir, "training_state.pth"))
                logger.info("Saving models and training states.")
            if current_iter % opt.val_freq == 0:
                if rank == 0:
                    g = net_g.module.eval()
                    psnr = []
                    with torch.no_grad():
                        for i in range(len(val_set)):
                            lq_v, gt_v = val_set[i]
                            sr = g(lq_v[None].to(device)).clamp(0, 1)
                            mse = F.mse_loss(sr, gt_v[None].to(device)).item()
                            psnr.append(10 * np.log10(1.0 / max(mse, 1e-10)))
                    g.train()
                    logger.info("Validation  # psnr: %.4f", float(np.mean(psnr)))
                dist.barrier()
            if current_iter >= opt.total_iter:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
