# -*- coding: utf-8 -*-
# DCGAN 人脸生成 (CelebA 64x64), 单机多卡 DDP
# 运行: python dcgan_ddp.py --dataroot /data/celeba --ngpu 4
import os
import time
import random
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils

parser = argparse.ArgumentParser(description="DCGAN 多卡训练")
parser.add_argument("--dataroot", default="/data/celeba")
parser.add_argument("--ngpu", type=int, default=4)
parser.add_argument("--batch_size", type=int, default=128, help="每张卡的 batch size")
parser.add_argument("--image_size", type=int, default=64)
parser.add_argument("--nz", type=int, default=100)
parser.add_argument("--ngf", type=int, default=64)
parser.add_argument("--ndf", type=int, default=64)
parser.add_argument("--epochs", type=int, default=25)
parser.add_argument("--lr", type=float, default=2e-4)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--outf", default="./output/dcgan")
parser.add_argument("--port", default="12355")
parser.add_argument("--seed", type=int, default=999)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, nz, ngf):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self, ndf):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
        )

    def forward(self, x):
        return self.main(x).view(-1)


def train(rank, world_size, opt):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = opt.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(opt.seed + rank)
    torch.manual_seed(opt.seed + rank)

    dataset = dset.ImageFolder(root=opt.dataroot, transform=transforms.Compose([
        transforms.Resize(opt.image_size),
        transforms.CenterCrop(opt.image_size),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ]))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=opt.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    netG = Generator(opt.nz, opt.ngf)
    netD = Discriminator(opt.ndf)
    netG.apply(weights_init)
    netD.apply(weights_init)
    # 同步 BN, 否则每张卡的统计量不一样
    netG = nn.SyncBatchNorm.convert_sync_batchnorm(netG).to(device)
    netD = nn.SyncBatchNorm.convert_sync_batchnorm(netD).to(device)
    # D 每步要前向两次, 关掉 buffer 广播 (SyncBN 下各卡 running stats 本来就一致)
    netG = DDP(netG, device_ids=[rank], broadcast_buffers=False)
    netD = DDP(netD, device_ids=[rank], broadcast_buffers=False)

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(64, opt.nz, 1, 1, device=device)
    optD = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    if rank == 0:
        os.makedirs(opt.outf, exist_ok=True)
    for epoch in range(opt.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (real, _) in enumerate(loader):
            real = real.to(device, non_blocking=True)
            b = real.size(0)
            # (1) 更新 D: maximize log(D(x)) + log(1 - D(G(z)))
            noise = torch.randn(b, opt.nz, 1, 1, device=device)
            fake = netG(noise)
            optD.zero_grad()
            errD_real = criterion(netD(real), torch.ones(b, device=device))
            errD_fake = criterion(netD(fake.detach()), torch.zeros(b, device=device))
            errD = errD_real + errD_fake
            errD.backward()
            optD.step()
            # (2) 更新 G: maximize log(D(G(z)))
            optG.zero_grad()
            errG = criterion(netD(fake), torch.ones(b, device=device))
            errG.backward()
            optG.step()

            if i % 100 == 0:
                stats = torch.stack([errD.detach(), errG.detach()])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f  %.1fs"
                          % (epoch, opt.epochs, i, len(loader), stats[0], stats[1], time.time() - t0))

        if rank == 0:
            netG.eval()
            with torch.no_grad():
                fake = netG.module(fixed_noise)
            netG.train()
            vutils.save_image(fake, "%s/fake_epoch_%03d.png" % (opt.outf, epoch), normalize=True)
            torch.save({"netG": netG.module.state_dict(), "netD": netD.module.state_dict(),
                        "optG": optG.state_dict(), "optD": optD.state_dict(), "epoch": epoch},
                       "%s/ckpt_epoch_%03d.pth" % (opt.outf, epoch))
        dist.barrier()

    dist.destroy_process_group()


opt = parser.parse_args()
print("启动 %d 个进程" % opt.ngpu)
mp.spawn(train, args=(opt.ngpu, opt), nprocs=opt.ngpu, join=True)
