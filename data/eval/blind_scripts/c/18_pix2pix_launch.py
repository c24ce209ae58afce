# -*- coding: utf-8 -*-
"""
pix2pix 配对图像翻译 (线稿->上色 / 语义图->街景), 多卡 DDP
    python -m torch.distributed.launch --nproc_per_node=4 train_pix2pix.py \
        --dataroot ./datasets/facades --name facades_pix2pix
"""
import os
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from PIL import Image
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from torchvision.utils import save_image


def get_opt():
    p = argparse.ArgumentParser("pix2pix")
    p.add_argument("--dataroot", required=True)
    p.add_argument("--name", default="pix2pix")
    p.add_argument("--checkpoints_dir", default="./checkpoints")
    p.add_argument("--direction", default="AtoB")
    p.add_argument("--batch_size", type=int, default=4, help="每张卡")
    p.add_argument("--n_epochs", type=int, default=100)
    p.add_argument("--n_epochs_decay", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lambda_L1", type=float, default=100.0)
    p.add_argument("--continue_train", action="store_true")
    # torch.distributed.launch 会传 --local_rank (1.x) 或 --local-rank (2.x)
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p.parse_args()


class AlignedDataset(Dataset):
    """A|B 拼在一张图里"""

    def __init__(self, root, phase, direction, train=True):
        d = os.path.join(root, phase)
        self.paths = sorted(os.path.join(d, f) for f in os.listdir(d) if f.lower().endswith((".jpg", ".png")))
        self.direction, self.train = direction, train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        ab = Image.open(self.paths[i]).convert("RGB")
        w, h = ab.size
        a, b = ab.crop((0, 0, w // 2, h)), ab.crop((w // 2, 0, w, h))
        if self.direction == "BtoA":
            a, b = b, a
        a, b = a.resize((286, 286), Image.BICUBIC), b.resize((286, 286), Image.BICUBIC)
        if self.train:
            x, y = np.random.randint(0, 31), np.random.randint(0, 31)
            a, b = a.crop((x, y, x + 256, y + 256)), b.crop((x, y, x + 256, y + 256))
            if np.random.rand() < 0.5:
                a, b = TF.hflip(a), TF.hflip(b)
        else:
            a, b = TF.center_crop(a, 256), TF.center_crop(b, 256)
        norm = T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
        return norm(a), norm(b)


class UnetBlock(nn.Module):
    def __init__(self, outer, inner, sub=None, outermost=False, innermost=False, dropout=False):
        super().__init__()
        self.outermost = outermost
        down = [nn.LeakyReLU(0.2, True), nn.Conv2d(outer, inner, 4, 2, 1)]
        if outermost:
            down = [nn.Conv2d(3, inner, 4, 2, 1)]
            up = [nn.ReLU(True), nn.ConvTranspose2d(inner * 2, 3, 4, 2, 1), nn.Tanh()]
            model = down + [sub] + up
        elif innermost:
            up = [nn.ReLU(True), nn.ConvTranspose2d(inner, outer, 4, 2, 1), nn.InstanceNorm2d(outer)]
            model = down + up
        else:
            down += [nn.InstanceNorm2d(inner)]
            up = [nn.ReLU(True), nn.ConvTranspose2d(inner * 2, outer, 4, 2, 1), nn.InstanceNorm2d(outer)]
            model = down + [sub] + up + ([nn.Dropout(0.5)] if dropout else [])
        self.model = nn.Sequential(*model)

    def forward(self, x):
        return self.model(x) if self.outermost else torch.cat([x, self.model(x)], 1)


def unet_256(ngf=64):
    blk = UnetBlock(ngf * 8, ngf * 8, innermost=True)
    for _ in range(3):
        blk = UnetBlock(ngf * 8, ngf * 8, blk, dropout=True)
    blk = UnetBlock(ngf * 4, ngf * 8, blk)
    blk = UnetBlock(ngf * 2, ngf * 4, blk)
    blk = UnetBlock(ngf, ngf * 2, blk)
    return UnetBlock(3, ngf, blk, outermost=True)


def patch_d(ndf=64):
    return nn.Sequential(
        nn.Conv2d(6, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf, ndf * 2, 4, 2, 1), nn.InstanceNorm2d(ndf * 2), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1), nn.InstanceNorm2d(ndf * 4), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 4, ndf * 8, 4, 1, 1), nn.InstanceNorm2d(ndf * 8), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 8, 1, 4, 1, 1))


def main():
    opt = get_opt()
    torch.cuda.set_device(opt.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", opt.local_rank)
    save_dir = os.path.join(opt.checkpoints_dir, opt.name)
    if rank == 0:
        os.makedirs(os.path.join(save_dir, "web"), exist_ok=True)
    np.random.seed(rank)

    train_set = AlignedDataset(opt.dataroot, "train", opt.direction)
    val_set = AlignedDataset(opt.dataroot, "val", opt.direction, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=opt.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    netG, netD = unet_256().to(device), patch_d().to(device)
    for m in list(netG.modules()) + list(netD.modules()):
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
    start_epoch = 0
    ckpt_path = os.path.join(save_dir, "latest.pth")
    if opt.continue_train and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        netG.load_state_dict(ckpt["G"])
        netD.load_state_dict(ckpt["D"])
        start_epoch = ckpt["epoch"] + 1
    netG = DDP(netG, device_ids=[opt.local_rank])
    netD = DDP(netD, device_ids=[opt.local_rank])

    optG = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(0.5, 0.999))
    rule = lambda e: 1.0 - max(0, e + 1 - opt.n_epochs) / float(opt.n_epochs_decay + 1)
    schedG = torch.optim.lr_scheduler.LambdaLR(optG, rule)
    schedD = torch.optim.lr_scheduler.LambdaLR(optD, rule)
    if opt.continue_train and os.path.exists(ckpt_path):
        optG.load_state_dict(ckpt["optG"])
        optD.load_state_dict(ckpt["optD"])
        schedG.load_state_dict(ckpt["schedG"])
        schedD.load_state_dict(ckpt["schedD"])
    gan_loss, l1 = nn.BCEWithLogitsLoss(), nn.L1Loss()

    for epoch in range(start_epoch, opt.n_epochs + opt.n_epochs_decay):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (real_A, real_B) in enumerate(loader):
            real_A, real_B = real_A.to(device), real_B.to(device)
            fake_B = netG(real_A)
            # 更新 D
            optD.zero_grad()
            pred_fake = netD(torch.cat([real_A, fake_B.detach()], 1))
            pred_real = netD(torch.cat([real_A, real_B], 1))
            loss_D = 0.5 * (gan_loss(pred_fake, torch.zeros_like(pred_fake)) +
                            gan_loss(pred_real, torch.ones_like(pred_real)))
            loss_D.backward()
            optD.step()
            # 更新 G (D 的参数不更新)
            for p in netD.parameters():
                p.requires_grad_(False)
            optG.zero_grad()
            pred_fake = netD(torch.cat([real_A, fake_B], 1))
            loss_G_GAN = gan_loss(pred_fake, torch.ones_like(pred_fake))
            loss_G_L1 = l1(fake_B, real_B) * opt.lambda_L1
            (loss_G_GAN + loss_G_L1).backward()
            optG.step()
            for p in netD.parameters():
                p.requires_grad_(True)

            if i % 50 == 0:
                logs = torch.stack([loss_G_GAN, loss_G_L1, loss_D]).detach()
                dist.all_reduce(logs)
                logs /= world_size
                if rank == 0:
                    print("(epoch: %d, iters: %d, time: %.3f) G_GAN: %.3f G_L1: %.3f D: %.3f"
                          % (epoch, i, time.time() - t0, *logs.tolist()))
        schedG.step()
        schedD.step()

        if rank == 0:
            # 在验证集上算 L1 并保存几张可视化结果
            g = netG.module
            g.eval()
            with torch.no_grad():
                errs, vis = [], []
                for j in range(len(val_set)):
                    a, b = val_set[j]
                    out = g(a[None].to(device))
                    errs.append((out - b[None].to(device)).abs().mean().item())
                    if j < 4:
                        vis += [a[None].to(device), out, b[None].to(device)]
            g.train()
            print("epoch %d val L1 %.4f" % (epoch, float(np.mean(errs))))
            save_image(torch.cat(vis) * 0.5 + 0.5, os.path.join(save_dir, "web", "epoch%03d.png" % epoch), nrow=3)
            torch.save({"G": netG.module.state_dict(), "D": netD.module.state_dict(),
                        "optG": optG.state_dict(), "optD": optD.state_dict(),
                        "schedG": schedG.state_dict(), "schedD": schedD.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
