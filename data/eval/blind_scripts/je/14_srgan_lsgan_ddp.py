"""SRGAN-style x4 super-resolution on CelebA-HQ faces (LSGAN loss, VGG content loss).

Ported from a single-GPU implementation to DDP.

    torchrun --nproc_per_node=4 14_srgan_lsgan_ddp.py --dataset_dir /data/celeba_hq/train --hr_size 256
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import spectral_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import VGG19_Weights, vgg19
from torchvision.utils import save_image

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


class ImageDataset(Dataset):
    def __init__(self, files, hr_shape):
        h, w = hr_shape
        self.lr_transform = transforms.Compose([
            transforms.Resize((h // 4, w // 4), transforms.InterpolationMode.BICUBIC),
            transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        self.hr_transform = transforms.Compose([
            transforms.Resize((h, w), transforms.InterpolationMode.BICUBIC),
            transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        self.files = files

    def __getitem__(self, index):
        img = Image.open(self.files[index % len(self.files)]).convert("RGB")
        if np.random.rand() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return {"lr": self.lr_transform(img), "hr": self.hr_transform(img)}

    def __len__(self):
        return len(self.files)


class FeatureExtractor(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature_extractor = nn.Sequential(*list(vgg19(weights=VGG19_Weights.IMAGENET1K_V1).features.children())[:18])

    def forward(self, img):
        return self.feature_extractor(img)


class ResidualBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv_block = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1), nn.PReLU(), nn.Conv2d(c, c, 3, 1, 1))

    def forward(self, x):
        return x + 0.2 * self.conv_block(x)


class GeneratorResNet(nn.Module):
    def __init__(self, in_channels=3, out_channels=3, n_residual_blocks=16):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(in_channels, 64, 9, 1, 4), nn.PReLU())
        self.res_blocks = nn.Sequential(*[ResidualBlock(64) for _ in range(n_residual_blocks)])
        self.conv2 = nn.Conv2d(64, 64, 3, 1, 1)
        self.upsampling = nn.Sequential(
            nn.Conv2d(64, 256, 3, 1, 1), nn.PixelShuffle(2), nn.PReLU(),
            nn.Conv2d(64, 256, 3, 1, 1), nn.PixelShuffle(2), nn.PReLU())
        self.conv3 = nn.Conv2d(64, out_channels, 9, 1, 4)

    def forward(self, x):
        out1 = self.conv1(x)
        out = self.conv2(self.res_blocks(out1)) + out1
        return self.conv3(self.upsampling(out))


class Discriminator(nn.Module):
    def __init__(self, input_shape):
        super().__init__()
        c, h, w = input_shape
        self.output_shape = (1, h // 2 ** 4, w // 2 ** 4)
        layers, in_f = [], c
        for i, out_f in enumerate([64, 128, 256, 512]):
            layers += [spectral_norm(nn.Conv2d(in_f, out_f, 3, 1, 1)), nn.LeakyReLU(0.2, inplace=True),
                       spectral_norm(nn.Conv2d(out_f, out_f, 3, 2, 1)), nn.LeakyReLU(0.2, inplace=True)]
            in_f = out_f
        layers.append(nn.Conv2d(512, 1, 3, 1, 1))
        self.model = nn.Sequential(*layers)

    def forward(self, img):
        return self.model(img)


def denormalize(t):
    mean = torch.tensor(MEAN, dtype=t.dtype, device=t.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=t.dtype, device=t.device).view(1, 3, 1, 1)
    return (t * std + mean).clamp(0, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset_dir", required=True)
    parser.add_argument("--n_epochs", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--b1", type=float, default=0.5)
    parser.add_argument("--b2", type=float, default=0.999)
    parser.add_argument("--n_cpu", type=int, default=8)
    parser.add_argument("--hr_size", type=int, default=256)
    parser.add_argument("--sample_interval", type=int, default=500)
    parser.add_argument("--checkpoint_interval", type=int, default=5)
    parser.add_argument("--out", default="srgan_out")
    opt = parser.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    Tensor = torch.cuda.FloatTensor

    hr_shape = (opt.hr_size, opt.hr_size)
    torch.manual_seed(0)
    generator = GeneratorResNet().to(device)
    discriminator = Discriminator((3, *hr_shape)).to(device)
    feature_extractor = FeatureExtractor().to(device).eval()
    for p in feature_extractor.parameters():
        p.requires_grad = False
    generator = DDP(generator, device_ids=[local_rank])
    discriminator = DDP(discriminator, device_ids=[local_rank])
    d_out_shape = discriminator.module.output_shape

    criterion_GAN = nn.MSELoss()
    criterion_content = nn.L1Loss()
    optimizer_G = torch.optim.Adam(generator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2))

    files = sorted(glob.glob(os.path.join(opt.dataset_dir, "*.jpg")) + glob.glob(os.path.join(opt.dataset_dir, "*.png")))
    dataset = ImageDataset(files, hr_shape)
    sampler = DistributedSampler(dataset, shuffle=True)
    dataloader = DataLoader(dataset, batch_size=opt.batch_size, sampler=sampler, num_workers=opt.n_cpu,
                            pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(os.path.join(opt.out, "images"), exist_ok=True)
        os.makedirs(os.path.join(opt.out, "saved_models"), exist_ok=True)

    for epoch in range(opt.n_epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, imgs in enumerate(dataloader):
            imgs_lr = imgs["lr"].to(device, non_blocking=True)
            imgs_hr = imgs["hr"].to(device, non_blocking=True)
            valid = Tensor(np.ones((imgs_lr.size(0), *d_out_shape)))
            fake = Tensor(np.zeros((imgs_lr.size(0), *d_out_shape)))

            # ---- generator
            optimizer_G.zero_grad()
            gen_hr = generator(imgs_lr)
            loss_GAN = criterion_GAN(discriminator(gen_hr), valid)
            loss_content = criterion_content(feature_extractor(gen_hr), feature_extractor(imgs_hr).detach())
            loss_G = loss_content + 1e-3 * loss_GAN
            loss_G.backward()
            optimizer_G.step()

            # ---- discriminator
            optimizer_D.zero_grad()
            loss_real = criterion_GAN(discriminator(imgs_hr), valid)
            loss_fake = criterion_GAN(discriminator(gen_hr.detach()), fake)
            loss_D = (loss_real + loss_fake) / 2
            loss_D.backward()
            optimizer_D.step()

            if rank == 0 and i % 50 == 0:
                print(f"[Epoch {epoch}/{opt.n_epochs}] [Batch {i}/{len(dataloader)}] "
                      f"[D loss: {loss_D.item():.4f}] [G loss: {loss_G.item():.4f}]", flush=True)
            batches_done = epoch * len(dataloader) + i
            if rank == 0 and batches_done % opt.sample_interval == 0:
                with torch.no_grad():
                    lr_up = F.interpolate(imgs_lr, scale_factor=4, mode="bicubic", align_corners=False)
                    grid = torch.cat([denormalize(lr_up[:4]), denormalize(gen_hr[:4]), denormalize(imgs_hr[:4])], 0)
                save_image(grid, os.path.join(opt.out, "images", f"{batches_done}.png"), nrow=4)

        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.0f}s", flush=True)
            if epoch % opt.checkpoint_interval == 0:
                torch.save(generator.module.state_dict(), os.path.join(opt.out, "saved_models", f"generator_{epoch}.pth"))
                torch.save(discriminator.module.state_dict(),
                           os.path.join(opt.out, "saved_models", f"discriminator_{epoch}.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
