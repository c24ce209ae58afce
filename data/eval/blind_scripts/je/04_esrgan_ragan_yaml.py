"""ESRGAN (RRDBNet x4) GAN stage, configured from a YAML file.

    torchrun --nproc_per_node=4 04_esrgan_ragan_yaml.py -opt options/train_ESRGAN_x4.yml

Example options file:
    name: ESRGAN_x4_DF2K
    datasets: {train: {dataroot_gt: /data/DF2K/HR_sub, dataroot_lq: /data/DF2K/LR_bicubic_X4_sub, gt_size: 128,
                       batch_size_per_gpu: 4, num_worker_per_gpu: 6},
               val: {dataroot_gt: /data/benchmark/Set14/HR, dataroot_lq: /data/benchmark/Set14/LR_bicubic/X4}}
    path: {pretrain_network_g: experiments/RRDBNet_PSNR_x4/models/net_g_1000000.pth, experiments_root: experiments}
    train: {lr_g: 1.0e-4, lr_d: 1.0e-4, total_iter: 400000, milestones: [50000, 100000, 200000, 300000],
            pixel_weight: 0.01, perceptual_weight: 1.0, gan_weight: 0.005}
"""
import argparse
import logging
import os
import os.path as osp
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from archs.rrdbnet_arch import RRDBNet  # same RRDBNet as in the PSNR stage

logger = logging.getLogger("basicsr")


class VGGStyleDiscriminator128(nn.Module):
    def __init__(self, num_in_ch=3, num_feat=64):
        super().__init__()
        chans = [num_feat, num_feat, num_feat * 2, num_feat * 2, num_feat * 4, num_feat * 4,
                 num_feat * 8, num_feat * 8, num_feat * 8, num_feat * 8]
        layers, c_in = [], num_in_ch
        for i, c in enumerate(chans):
            stride = 2 if i % 2 == 1 else 1
            layers.append(nn.Conv2d(c_in, c, 4 if stride == 2 else 3, stride, 1, bias=(i == 0)))
            if i > 0:
                layers.append(nn.BatchNorm2d(c, affine=True))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            c_in = c
        self.body = nn.Sequential(*layers)
        self.linear1 = nn.Linear(num_feat * 8 * 4 * 4, 100)
        self.linear2 = nn.Linear(100, 1)

    def forward(self, x):
        assert x.shape[-2:] == (128, 128), f"input must be 128x128, got {tuple(x.shape)}"
        feat = self.body(x).flatten(1)
        return self.linear2(F.leaky_relu(self.linear1(feat), 0.2))


class VGGFeatureLoss(nn.Module):
    def __init__(self, layer_idx=34):
        super().__init__()
        vgg = torchvision.models.vgg19(weights="IMAGENET1K_V1").features[:layer_idx + 1]
        self.vgg = vgg.eval().requires_grad_(False)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        fx = self.vgg((x - self.mean) / self.std)
        fg = self.vgg((gt - self.mean) / self.std).detach()
        return F.l1_loss(fx, fg)


class PairedImageDataset(Dataset):
    def __init__(self, opt, train):
        self.gt_paths = sorted(glob(osp.join(opt["dataroot_gt"], "*.png")))
        self.lq_paths = sorted(glob(osp.join(opt["dataroot_lq"], "*.png")))
        assert len(self.gt_paths) == len(self.lq_paths), "gt/lq folders differ in length"
        self.gt_size = opt.get("gt_size", 128)
        self.train = train

    def __len__(self):
        return len(self.gt_paths)

    def __getitem__(self, index):
        img_gt = cv2.imread(self.gt_paths[index])[:, :, ::-1].astype(np.float32) / 255.0
        img_lq = cv2.imread(self.lq_paths[index])[:, :, ::-1].astype(np.float32) / 255.0
        if self.train:
            lq_size = self.gt_size // 4
            top = random.randint(0, img_lq.shape[0] - lq_size)
            left = random.randint(0, img_lq.shape[1] - lq_size)
            img_lq = img_lq[top:top + lq_size, left:left + lq_size]
            img_gt = img_gt[top * 4:top * 4 + self.gt_size, left * 4:left * 4 + self.gt_size]
            if random.random() < 0.5:
                img_gt, img_lq = img_gt[:, ::-1], img_lq[:, ::-1]
            if random.random() < 0.5:
                img_gt, img_lq = img_gt.transpose(1, 0, 2), img_lq.transpose(1, 0, 2)
        else:
            img_gt = img_gt[:img_lq.shape[0] * 4, :img_lq.shape[1] * 4]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return {"lq": to_t(img_lq), "gt": to_t(img_gt)}


def calculate_psnr_y(sr, gt, crop_border=4):
    coef = torch.tensor([65.481, 128.553, 24.966], device=sr.device).view(1, 3, 1, 1)
    sr_y = (((sr.clamp(0, 1) * 255).round() / 255) * coef).sum(1) + 16.0
    gt_y = (gt * coef).sum(1) + 16.0
    sr_y = sr_y[:, crop_border:-crop_border, crop_border:-crop_border]
    gt_y = gt_y[:, crop_border:-crop_border, crop_border:-crop_border]
    return 10.0 * torch.log10(255.0 ** 2 / ((sr_y - gt_y) ** 2).mean())


class ESRGANModel:
    def __init__(self, opt, device, local_rank):
        self.opt, self.device = opt, device
        train_opt = opt["train"]
        net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32).to(device)
        load_path = opt["path"].get("pretrain_network_g")
        if load_path:
            ckpt = torch.load(load_path, map_location=lambda storage, loc: storage)
            net_g.load_state_dict(ckpt.get("params", ckpt), strict=True)
        net_d = VGGStyleDiscriminator128().to(device)
        self.net_g = DistributedDataParallel(net_g, device_ids=[local_rank])
        self.net_d = DistributedDataParallel(net_d, device_ids=[local_rank])
        self.cri_perceptual = VGGFeatureLoss().to(device)
        self.cri_gan = nn.BCEWithLogitsLoss()
        self.w_pix, self.w_per, self.w_gan = train_opt["pixel_weight"], train_opt["perceptual_weight"], train_opt["gan_weight"]
        self.optimizer_g = torch.optim.Adam(self.net_g.parameters(), lr=train_opt["lr_g"], betas=(0.9, 0.99))
        self.optimizer_d = torch.optim.Adam(self.net_d.parameters(), lr=train_opt["lr_d"], betas=(0.9, 0.99))
        self.schedulers = [torch.optim.lr_scheduler.MultiStepLR(o, train_opt["milestones"], 0.5)
                           for o in (self.optimizer_g, self.optimizer_d)]
        self.log = {}

    def optimize_parameters(self, lq, gt):
        # G
        for p in self.net_d.parameters():
            p.requires_grad = False
        self.optimizer_g.zero_grad()
        fake = self.net_g(lq)
        l_pix = F.l1_loss(fake, gt)
        l_per = self.cri_perceptual(fake, gt)
        pred_g_fake = self.net_d(fake)
        pred_d_real = self.net_d(gt).detach()
        l_g_gan = (self.cri_gan(pred_d_real - pred_g_fake.mean(), torch.zeros_like(pred_d_real)) +
                   self.cri_gan(pred_g_fake - pred_d_real.mean(), torch.ones_like(pred_g_fake))) / 2
        l_g_total = self.w_pix * l_pix + self.w_per * l_per + self.w_gan * l_g_gan
        l_g_total.backward()
        self.optimizer_g.step()

        # D
        for p in self.net_d.parameters():
            p.requires_grad = True
        self.optimizer_d.zero_grad()
        pred_d_real = self.net_d(gt)
        pred_d_fake = self.net_d(fake.detach())
        l_d_real = self.cri_gan(pred_d_real - pred_d_fake.mean(), torch.ones_like(pred_d_real))
        l_d_fake = self.cri_gan(pred_d_fake - pred_d_real.mean(), torch.zeros_like(pred_d_fake))
        l_d_total = (l_d_real + l_d_fake) / 2
        l_d_total.backward()
        self.optimizer_d.step()
        for s in self.schedulers:
            s.step()

        self.log = {"l_pix": l_pix.item(), "l_percep": l_per.item(), "l_g_gan": l_g_gan.item(),
                    "l_d": l_d_total.item(), "D_real": pred_d_real.mean().item(), "D_fake": pred_d_fake.mean().item()}

    @torch.no_grad()
    def validation(self, val_set, rank, world_size):
        net = self.net_g.module
        net.eval()
        total = torch.zeros(2, device=self.device)
        for idx in range(rank, len(val_set), world_size):
            data = val_set[idx]
            sr = net(data["lq"].unsqueeze(0).to(self.device))
            total[0] += calculate_psnr_y(sr, data["gt"].unsqueeze(0).to(self.device))
            total[1] += 1
        dist.all_reduce(total)
        net.train()
        return (total[0] / total[1]).item()

    def save(self, path, it):
        torch.save({"iter": it, "params": self.net_g.module.state_dict(), "net_d": self.net_d.module.state_dict(),
                    "optimizer_g": self.optimizer_g.state_dict(), "optimizer_d": self.optimizer_d.state_dict()}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-opt", required=True)
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    exp_dir = osp.join(opt["path"]["experiments_root"], opt["name"])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, "models"), exist_ok=True)
    seed = opt.get("manual_seed", 0)
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed(seed + rank)

    train_set = PairedImageDataset(opt["datasets"]["train"], train=True)
    val_set = PairedImageDataset(opt["datasets"]["val"], train=False)
    dopt = opt["datasets"]["train"]
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank)
    loader = DataLoader(train_set, batch_size=dopt["batch_size_per_gpu"], sampler=sampler,
                        num_workers=dopt["num_worker_per_gpu"], pin_memory=True, drop_last=True)
    model = ESRGANModel(opt, device, local_rank)

    total_iter = opt["train"]["total_iter"]
    current_iter, epoch = 0, 0
    logger.info("start training: %d iters, %d images, world size %d", total_iter, len(train_set), world_size)
    tic = time.time()
    while current_iter < total_iter:
        sampler.set_epoch(epoch)
        for batch in loader:
            current_iter += 1
            model.optimize_parameters(batch["lq"].to(device, non_blocking=True),
                                      batch["gt"].to(device, non_blocking=True))
            if current_iter % 100 == 0:
                msg = " ".join(f"{k}: {v:.4e}" for k, v in model.log.items())
                logger.info("[iter %d] %s (%.2fs)", current_iter, msg, time.time() - tic)
                tic = time.time()
            if current_iter % 5000 == 0:
                psnr = model.validation(val_set, rank, world_size)
                logger.info("[iter %d] Set14 PSNR-Y %.4f", current_iter, psnr)
                if rank == 0:
                    model.save(osp.join(exp_dir, "models", f"net_{current_iter}.pth"), current_iter)
            if current_iter >= total_iter:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
