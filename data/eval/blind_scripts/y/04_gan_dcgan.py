#!/usr/bin/env python3
# DCGAN on CelebA 64x64, multi-GPU with torchrun.
#   torchrun --standalone --nproc_per_node=4 dcgan_ddp.py --dataroot /data/celeba --outf out/dcgan
import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--dataroot", required=True)
parser.add_argument("--workers", type=int, default=6)
parser.add_argument("--batchSize", type=int, default=128)
parser.add_argument("--imageSize", type=int, default=64)
parser.add_argument("--nz", type=int, default=100)
parser.add_argument("--ngf", type=int, default=64)
parser.add_argument("--ndf", type=int, default=64)
parser.add_argument("--niter", type=int, default=25)
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--outf", default="out/dcgan")
parser.add_argument("--netG", default="")
parser.add_argument("--netD", default="")
parser.add_argument("--manualSeed", type=int, default=999)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
        )

    def forward(self, x):
        return self.main(x).view(-1)


def main():
    opt = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(opt.manualSeed + rank)
    torch.manual_seed(opt.manualSeed + rank)
    if rank == 0:
        os.makedirs(opt.outf, exist_ok=True)
        print(opt)

    dataset = dset.ImageFolder(
        root=opt.dataroot,
        transform=transforms.Compose([
            transforms.Resize(opt.imageSize),
            transforms.CenterCrop(opt.imageSize),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]),
    )
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize, sampler=sampler,
                                             num_workers=opt.workers, pin_memory=True, drop_last=True)

    netG = Generator(opt.nz, opt.ngf).to(device)
    netG.apply(weights_init)
    if opt.netG:
        netG.load_state_dict(torch.load(opt.netG, map_location=device))
    netD = Discriminator(opt.ndf).to(device)
    netD.apply(weights_init)
    if opt.netD:
        netD.load_state_dict(torch.load(opt.netD, map_location=device))

    # DDP broadcasts rank 0's initial weights, so the per-rank seeds above only affect noise
    netG = DDP(netG, device_ids=[local_rank])
    netD = DDP(netD, device_ids=[local_rank])

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(64, opt.nz, 1, 1, generator=torch.Generator().manual_seed(0)).to(device)
    real_label, fake_label = 1.0, 0.0

    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    for epoch in range(opt.niter):
        sampler.set_epoch(epoch)
        for i, (real, _) in enumerate(dataloader):
            real = real.to(device, non_blocking=True)
            b = real.size(0)

            ############################
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            optimizerD.zero_grad(set_to_none=True)
            label = torch.full((b,), real_label, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            D_x = torch.sigmoid(output).mean()

            noise = torch.randn(b, opt.nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            D_G_z1 = torch.sigmoid(output).mean()
            errD = errD_real + errD_fake
            errD.backward()
            optimizerD.step()

            ############################
            # (2) Update G: maximize log(D(G(z)))
            ###########################
            optimizerG.zero_grad(set_to_none=True)
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = torch.sigmoid(output).mean()
            optimizerG.step()

            if i % 50 == 0:
                stats = torch.stack([errD.detach(), errG.detach(), D_x.detach(),
                                     D_G_z1.detach(), D_G_z2.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                          % (epoch, opt.niter, i, len(dataloader), *stats.tolist()))

            if i % 500 == 0 and rank == 0:
                vutils.save_image(real[:64], f"{opt.outf}/real_samples.png", normalize=True)
                with torch.no_grad():
                    netG.module.eval()
                    samples = netG.module(fixed_noise)
                    netG.module.train()
                vutils.save_image(samples, f"{opt.outf}/fake_samples_epoch_{epoch:03d}.png", normalize=True)

        if rank == 0:
            torch.save(netG.module.state_dict(), f"{opt.outf}/netG_epoch_{epoch}.pth")
            torch.save(netD.module.state_dict(), f"{opt.outf}/netD_epoch_{epoch}.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
