#!/usr/bin/env python
# DCGAN on CelebA 64x64, multi-gpu with mp.spawn (single node)
#   python 03_dcgan_spawn.py --dataroot /data/celeba --gpus 4
import os
import time
import random
import argparse

import torch
import torch.nn as nn
import torch.optim as optim
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.data
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument('--dataroot', required=True)
parser.add_argument('--workers', type=int, default=4)
parser.add_argument('--batchSize', type=int, default=128)
parser.add_argument('--imageSize', type=int, default=64)
parser.add_argument('--nz', type=int, default=100)
parser.add_argument('--ngf', type=int, default=64)
parser.add_argument('--ndf', type=int, default=64)
parser.add_argument('--niter', type=int, default=25)
parser.add_argument('--lr', type=float, default=0.0002)
parser.add_argument('--beta1', type=float, default=0.5)
parser.add_argument('--gpus', type=int, default=torch.cuda.device_count())
parser.add_argument('--port', type=str, default='29512')
parser.add_argument('--outf', default='out_dcgan')
parser.add_argument('--manualSeed', type=int, default=999)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.constant_(m.bias, 0)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False))

    def forward(self, x):
        return self.main(x).view(-1)


def main_worker(ngpus_per_node, gpu, opt):
    rank = gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group('nccl', init_method='tcp://127.0.0.1:' + opt.port,
                            world_size=ngpus_per_node, rank=rank)
    random.seed(opt.manualSeed + rank)
    torch.manual_seed(opt.manualSeed + rank)
    device = torch.device('cuda', gpu)

    dataset = dset.ImageFolder(root=opt.dataroot, transform=transforms.Compose([
        transforms.Resize(opt.imageSize), transforms.CenterCrop(opt.imageSize),
        transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]))
    sampler = DistributedSampler(dataset, num_replicas=ngpus_per_node, rank=rank, shuffle=True)
    per_gpu_bs = opt.batchSize // ngpus_per_node
    loader = torch.utils.data.DataLoader(dataset, batch_size=per_gpu_bs, sampler=sampler,
                                         num_workers=opt.workers, pin_memory=True, drop_last=True)

    torch.manual_seed(opt.manualSeed)
    netG = Generator(opt.nz, opt.ngf).to(device)
    netD = Discriminator(opt.ndf).to(device)
    netG.apply(weights_init)
    netD.apply(weights_init)
    torch.manual_seed(opt.manualSeed + rank)
    netG = DDP(netG, device_ids=[gpu])
    netD = DDP(netD, device_ids=[gpu], broadcast_buffers=False)

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(64, opt.nz, 1, 1, device=device)
    optD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    if rank == 0:
        os.makedirs(opt.outf, exist_ok=True)

    for epoch in range(opt.niter):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (real, _) in enumerate(loader):
            real = real.to(device, non_blocking=True)
            b = real.size(0)
            ones = torch.ones(b, device=device)
            zeros = torch.zeros(b, device=device)

            # (1) update D
            netD.zero_grad()
            errD_real = criterion(netD(real), ones)
            errD_real.backward()
            noise = torch.randn(b, opt.nz, 1, 1, device=device)
            fake = netG(noise)
            errD_fake = criterion(netD(fake.detach()), zeros)
            errD_fake.backward()
            optD.step()

            # (2) update G
            netG.zero_grad()
            errG = criterion(netD(fake), ones)
            errG.backward()
            optG.step()

            if i % 50 == 0:
                stats = torch.stack([errD_real + errD_fake, errG]).detach()
                dist.all_reduce(stats)
                stats /= ngpus_per_node
                if rank == 0:
                    print('[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f (%.1fs)' % (
                        epoch, opt.niter, i, len(loader), stats[0].item(), stats[1].item(), time.time() - t0))

        if rank == 0:
            with torch.no_grad():
                fake = netG.module(fixed_noise).cpu()
            vutils.save_image(fake, '%s/fake_samples_epoch_%03d.png' % (opt.outf, epoch), normalize=True)
            torch.save({'G': netG.module.state_dict(), 'D': netD.module.state_dict(), 'epoch': epoch},
                       '%s/ckpt_epoch_%d.pth' % (opt.outf, epoch))

    dist.destroy_process_group()


def main():
    opt = parser.parse_args()
    print(opt)
    ngpus = opt.gpus
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, opt))


if __name__ == '__main__':
    main()
