#!/usr/bin/env python
# DCGAN on CelebA 64x64, multi-GPU version of the pytorch/examples dcgan script.
#   torchrun --nproc_per_node=4 dcgan_ddp.py --dataroot /data/celeba --outf out/dcgan_celeba
import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
import torchvision.datasets as dset
import torchvision.transforms as transforms
import torchvision.utils as vutils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.image.fid import FrechetInceptionDistance

parser = argparse.ArgumentParser()
parser.add_argument("--dataroot", required=True, help="path to dataset")
parser.add_argument("--workers", type=int, default=4)
parser.add_argument("--batchSize", type=int, default=128, help="input batch size per GPU")
parser.add_argument("--imageSize", type=int, default=64)
parser.add_argument("--nz", type=int, default=100, help="size of the latent z vector")
parser.add_argument("--ngf", type=int, default=64)
parser.add_argument("--ndf", type=int, default=64)
parser.add_argument("--niter", type=int, default=25, help="number of epochs to train for")
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--netG", default="", help="path to netG (to continue training)")
parser.add_argument("--netD", default="", help="path to netD (to continue training)")
parser.add_argument("--outf", default="out", help="folder to output images and model checkpoints")
parser.add_argument("--manualSeed", type=int, default=999)
parser.add_argument("--fid_images", type=int, default=10000)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz, ngf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
        )

    def forward(self, input):
        return self.main(input).view(-1)


def to_uint8(x):
    return ((x.clamp(-1, 1) + 1) * 127.5).to(torch.uint8)


def main():
    opt = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(opt.manualSeed)
    torch.manual_seed(opt.manualSeed)

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
    sampler = DistributedSampler(dataset, shuffle=True, seed=opt.manualSeed, drop_last=True)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize, sampler=sampler,
                                             num_workers=opt.workers, pin_memory=True, drop_last=True)

    netG = Generator(opt.nz, opt.ngf).to(device)
    netG.apply(weights_init)
    if opt.netG != "":
        netG.load_state_dict(torch.load(opt.netG, map_location=device))

    netD = Discriminator(opt.ndf).to(device)
    netD.apply(weights_init)
    if opt.netD != "":
        netD.load_state_dict(torch.load(opt.netD, map_location=device))

    netG = DDP(netG, device_ids=[local_rank])
    netD = DDP(netD, device_ids=[local_rank])

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(64, opt.nz, 1, 1, device=device)
    real_label, fake_label = 1.0, 0.0

    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    fid = FrechetInceptionDistance(feature=2048).to(device)

    # different noise on every rank from here on
    torch.manual_seed(opt.manualSeed + rank)

    for epoch in range(opt.niter):
        sampler.set_epoch(epoch)
        netG.train()
        netD.train()
        for i, (real_cpu, _) in enumerate(dataloader):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            real = real_cpu.to(device, non_blocking=True)
            b_size = real.size(0)
            noise = torch.randn(b_size, opt.nz, 1, 1, device=device)
            fake = netG(noise)

            netD.zero_grad(set_to_none=True)
            out_real = netD(real)
            out_fake = netD(fake.detach())
            errD_real = criterion(out_real, torch.full((b_size,), real_label, device=device))
            errD_fake = criterion(out_fake, torch.full((b_size,), fake_label, device=device))
            errD = errD_real + errD_fake
            errD.backward()
            optimizerD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad(set_to_none=True)
            output = netD(fake)
            errG = criterion(output, torch.full((b_size,), real_label, device=device))
            errG.backward()
            optimizerG.step()

            if i % 50 == 0:
                stats = torch.stack([errD.detach(), errG.detach(),
                                     torch.sigmoid(out_real).mean().detach(),
                                     torch.sigmoid(output).mean().detach()])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    d, g, dx, dgz = stats.tolist()
                    print(f"[{epoch}/{opt.niter}][{i}/{len(dataloader)}] Loss_D: {d:.4f} Loss_G: {g:.4f} "
                          f"D(x): {dx:.4f} D(G(z)): {dgz:.4f}", flush=True)

        # ---- evaluation: FID on fid_images real vs. generated images, split over ranks ----
        netG.eval()
        fid.reset()
        per_rank = opt.fid_images // world_size
        seen = 0
        with torch.no_grad():
            for real_cpu, _ in dataloader:
                if seen >= per_rank:
                    break
                real = real_cpu[: per_rank - seen].to(device)
                fid.update(to_uint8(real), real=True)
                z = torch.randn(real.size(0), opt.nz, 1, 1, device=device)
                fid.update(to_uint8(netG.module(z)), real=False)
                seen += real.size(0)
        fid_value = fid.compute().item()

        if rank == 0:
            print(f"epoch {epoch}: FID {fid_value:.2f}", flush=True)
            with torch.no_grad():
                fake = netG.module(fixed_noise)
            vutils.save_image(real_cpu, f"{opt.outf}/real_samples.png", normalize=True)
            vutils.save_image(fake.detach(), f"{opt.outf}/fake_samples_epoch_{epoch:03d}.png", normalize=True)
            torch.save(netG.module.state_dict(), f"{opt.outf}/netG_epoch_{epoch}.pth")
            torch.save(netD.module.state_dict(), f"{opt.outf}/netD_epoch_{epoch}.pth")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
