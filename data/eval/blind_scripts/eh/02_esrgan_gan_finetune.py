#!/usr/bin/env python
"""ESRGAN x4 GAN stage: RRDBNet generator initialised from the PSNR-oriented model,
VGG-style discriminator, relativistic average GAN + VGG19 perceptual + L1.

    torchrun --nproc_per_node=4 02_esrgan_gan_finetune.py -opt options/esrgan_x4_gan.yml
"""
import argparse
import logging
import math
import os
import os.path as osp
import random
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("esrgan")


# ------------------------------------------------------------------ networks
class ResidualDenseBlock(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf, gc=32):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = (ResidualDenseBlock(nf, gc) for _ in range(3))

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


class VGGStyleDiscriminator(nn.Module):
    """Input 128x128, as in the ESRGAN paper."""

    def __init__(self, nf=64):
        super().__init__()
        chans = [nf, nf * 2, nf * 4, nf * 8, nf * 8]
        layers = [nn.Conv2d(3, nf, 3, 1, 1), nn.LeakyReLU(0.2, True),
                  nn.Conv2d(nf, nf, 4, 2, 1, bias=False), nn.BatchNorm2d(nf), nn.LeakyReLU(0.2, True)]
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True),
                       nn.Conv2d(cout, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True)]
        self.features = nn.Sequential(*layers)
        self.linear1 = nn.Linear(nf * 8 * 4 * 4, 100)
        self.linear2 = nn.Linear(100, 1)

    def forward(self, x):
        feat = self.features(x).flatten(1)
        return self.linear2(F.leaky_relu(self.linear1(feat), 0.2))


class PerceptualLoss(nn.Module):
    """VGG19 conv5_4 (before activation), L1 distance."""

    def __init__(self, vgg_path):
        super().__init__()
        vgg = torchvision.models.vgg19()
        vgg.load_state_dict(torch.load(vgg_path, map_location="cpu"))
        self.features = vgg.features[:35].eval()
        for p in self.features.parameters():
            p.requires_grad = False
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        fx = self.features((x - self.mean) / self.std)
        fg = self.features((gt.detach() - self.mean) / self.std)
        return F.l1_loss(fx, fg)


# ------------------------------------------------------------------ data
class PairedImageDataset(Dataset):
    def __init__(self, gt_dir, lq_dir, scale=4, gt_size=None):
        self.gt_paths = sorted(glob(osp.join(gt_dir, "*.png")))
        self.lq_paths = [osp.join(lq_dir, osp.basename(p)) for p in self.gt_paths]
        self.scale, self.gt_size = scale, gt_size

    def __len__(self):
        return len(self.gt_paths)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt_paths[i])[:, :, ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(self.lq_paths[i])[:, :, ::-1].astype(np.float32) / 255.0
        if self.gt_size:
            lq_size = self.gt_size // self.scale
            h, w = lq.shape[:2]
            top, left = random.randint(0, h - lq_size), random.randint(0, w - lq_size)
            lq = lq[top:top + lq_size, left:left + lq_size]
            s = self.scale
            gt = gt[top * s:(top + lq_size) * s, left * s:(left + lq_size) * s]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
            if random.random() < 0.5:
                lq, gt = lq.transpose(1, 0, 2), gt.transpose(1, 0, 2)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return {"lq": to_t(lq), "gt": to_t(gt)}


def psnr_y(sr, gt, crop):
    w = torch.tensor([65.481, 128.553, 24.966], device=sr.device).view(1, 3, 1, 1)
    sr_y = (sr * w).sum(1) / 255.0 + 16 / 255.0
    gt_y = (gt * w).sum(1) / 255.0 + 16 / 255.0
    sr_y, gt_y = sr_y[..., crop:-crop, crop:-crop], gt_y[..., crop:-crop, crop:-crop]
    mse = torch.mean((sr_y.double() - gt_y.double()) ** 2)
    return (10 * torch.log10(1.0 / mse)).item()


# ------------------------------------------------------------------ main
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-opt", required=True)
    opt = yaml.safe_load(open(parser.parse_args().opt))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [%(name)s] %(message)s")
    seed = opt.get("manual_seed", 0)
    torch.manual_seed(seed)
    random.seed(seed + rank)
    np.random.seed(seed + rank)

    exp_dir = osp.join("experiments", opt["name"])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, "models"), exist_ok=True)

    dopt = opt["datasets"]
    train_set = PairedImageDataset(dopt["train"]["gt"], dopt["train"]["lq"], 4, dopt["train"]["gt_size"])
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=dopt["train"]["batch_size_per_gpu"], sampler=sampler,
                              num_workers=dopt["train"].get("num_worker_per_gpu", 6), pin_memory=True,
                              drop_last=True)
    val_set = PairedImageDataset(dopt["val"]["gt"], dopt["val"]["lq"], 4)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), batch_size=1)

    net_g = RRDBNet().to(device)
    if opt.get("pretrain_g"):
        net_g.load_state_dict(torch.load(opt["pretrain_g"], map_location="cpu")["params"], strict=True)
    net_d = VGGStyleDiscriminator().to(device)
    net_g = DistributedDataParallel(net_g, device_ids=[local_rank])
    net_d = DistributedDataParallel(net_d, device_ids=[local_rank])

    cri_pix = nn.L1Loss().to(device)
    cri_perceptual = PerceptualLoss(opt["vgg_path"]).to(device)
    cri_gan = nn.BCEWithLogitsLoss().to(device)
    w_pix, w_percep, w_gan = 1e-2, 1.0, 5e-3

    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-4, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-4, betas=(0.9, 0.99))
    milestones = [50000, 100000, 200000, 300000]
    sched_g = torch.optim.lr_scheduler.MultiStepLR(opt_g, milestones, 0.5)
    sched_d = torch.optim.lr_scheduler.MultiStepLR(opt_d, milestones, 0.5)

    total_iter = opt["train"]["total_iter"]
    current_iter, epoch = 0, 0
    while current_iter < total_iter:
        sampler.set_epoch(epoch)
        for batch in train_loader:
            current_iter += 1
            lq = batch["lq"].to(device, non_blocking=True)
            gt = batch["gt"].to(device, non_blocking=True)

            # generator
            for p in net_d.parameters():
                p.requires_grad = False
            opt_g.zero_grad()
            output = net_g(lq)
            l_g_pix = w_pix * cri_pix(output, gt)
            l_g_percep = w_percep * cri_perceptual(output, gt)
            real_d_pred = net_d(gt).detach()
            fake_g_pred = net_d(output)
            l_g_real = cri_gan(real_d_pred - torch.mean(fake_g_pred), torch.zeros_like(real_d_pred))
            l_g_fake = cri_gan(fake_g_pred - torch.mean(real_d_pred), torch.ones_like(fake_g_pred))
            l_g_gan = w_gan * (l_g_real + l_g_fake) / 2
            (l_g_pix + l_g_percep + l_g_gan).backward()
            opt_g.step()

            # discriminator
            for p in net_d.parameters():
                p.requires_grad = True
            opt_d.zero_grad()
            real_d_pred = net_d(gt)
            fake_d_pred = net_d(output.detach())
            l_d_real = cri_gan(real_d_pred - torch.mean(fake_d_pred), torch.ones_like(real_d_pred)) * 0.5
            l_d_fake = cri_gan(fake_d_pred - torch.mean(real_d_pred), torch.zeros_like(fake_d_pred)) * 0.5
            (l_d_real + l_d_fake).backward()
            opt_d.step()
            sched_g.step()
            sched_d.step()

            if current_iter % 100 == 0:
                log.info("iter %d  l_pix %.4f l_percep %.4f l_g_gan %.4f l_d_real %.4f l_d_fake %.4f",
                         current_iter, l_g_pix.item(), l_g_percep.item(), l_g_gan.item(),
                         l_d_real.item(), l_d_fake.item())

            if current_iter % opt["val"]["val_freq"] == 0:
                g = net_g.module
                g.eval()
                stats = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for vb in val_loader:
                        sr = g(vb["lq"].to(device)).clamp(0, 1)
                        sr = torch.round(sr * 255) / 255
                        stats[0] += psnr_y(sr, vb["gt"].to(device), crop=4)
                        stats[1] += 1
                g.train()
                dist.all_reduce(stats)
                log.info("[val] iter %d  PSNR-Y %.3f dB on %d images", current_iter,
                         (stats[0] / stats[1]).item(), int(stats[1].item()))

            if current_iter % opt["logger"]["save_checkpoint_freq"] == 0 and rank == 0:
                torch.save({"params": net_g.module.state_dict()},
                           osp.join(exp_dir, "models", f"net_g_{current_iter}.pth"))
                torch.save({"params": net_d.module.state_dict()},
                           osp.join(exp_dir, "models", f"net_d_{current_iter}.pth"))
            if current_iter >= total_iter:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
