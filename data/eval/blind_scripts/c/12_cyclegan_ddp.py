# -*- coding: utf-8 -*-
"""
CycleGAN 非配对图像翻译 (horse2zebra / 白天->夜晚), DDP 多卡版本
torchrun --nproc_per_node=4 train_cyclegan.py --dataroot datasets/day2night --name day2night
"""
import os
import glob
import random
import argparse
import itertools

import torch
import torch.nn as nn
import torch.distributed as dist
from PIL import Image
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.transforms as T
from torchvision.utils import save_image


def get_opt():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", required=True)
    p.add_argument("--name", default="cyclegan")
    p.add_argument("--checkpoints_dir", default="./checkpoints")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--load_size", type=int, default=286)
    p.add_argument("--crop_size", type=int, default=256)
    p.add_argument("--n_epochs", type=int, default=100)
    p.add_argument("--n_epochs_decay", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lambda_cyc", type=float, default=10.0)
    p.add_argument("--lambda_idt", type=float, default=0.5)
    p.add_argument("--pool_size", type=int, default=50)
    p.add_argument("--num_threads", type=int, default=4)
    p.add_argument("--display_freq", type=int, default=400)
    return p.parse_args()


class UnalignedDataset(Dataset):
    def __init__(self, root, load_size, crop_size):
        self.A = sorted(glob.glob(os.path.join(root, "trainA", "*")))
        self.B = sorted(glob.glob(os.path.join(root, "trainB", "*")))
        self.tf = T.Compose([T.Resize(load_size, T.InterpolationMode.BICUBIC), T.RandomCrop(crop_size),
                             T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])

    def __len__(self):
        return max(len(self.A), len(self.B))

    def __getitem__(self, idx):
        a = Image.open(self.A[idx % len(self.A)]).convert("RGB")
        b = Image.open(self.B[random.randint(0, len(self.B) - 1)]).convert("RGB")
        return self.tf(a), self.tf(b)


class ResnetBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.block = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(dim, dim, 3), nn.InstanceNorm2d(dim), nn.ReLU(True),
                                   nn.ReflectionPad2d(1), nn.Conv2d(dim, dim, 3), nn.InstanceNorm2d(dim))

    def forward(self, x):
        return x + self.block(x)


def resnet_generator(ngf=64, n_blocks=9):
    layers = [nn.ReflectionPad2d(3), nn.Conv2d(3, ngf, 7), nn.InstanceNorm2d(ngf), nn.ReLU(True)]
    for i in range(2):
        m = 2 ** i
        layers += [nn.Conv2d(ngf * m, ngf * m * 2, 3, 2, 1), nn.InstanceNorm2d(ngf * m * 2), nn.ReLU(True)]
    layers += [ResnetBlock(ngf * 4) for _ in range(n_blocks)]
    for i in range(2):
        m = 2 ** (2 - i)
        layers += [nn.ConvTranspose2d(ngf * m, ngf * m // 2, 3, 2, 1, output_padding=1),
                   nn.InstanceNorm2d(ngf * m // 2), nn.ReLU(True)]
    layers += [nn.ReflectionPad2d(3), nn.Conv2d(ngf, 3, 7), nn.Tanh()]
    return nn.Sequential(*layers)


def patch_discriminator(ndf=64):
    return nn.Sequential(
        nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf, ndf * 2, 4, 2, 1), nn.InstanceNorm2d(ndf * 2), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1), nn.InstanceNorm2d(ndf * 4), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 4, ndf * 8, 4, 1, 1), nn.InstanceNorm2d(ndf * 8), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 8, 1, 4, 1, 1))


class ImagePool:
    def __init__(self, size):
        self.size, self.images = size, []

    def query(self, imgs):
        out = []
        for img in imgs:
            img = img.unsqueeze(0)
            if len(self.images) < self.size:
                self.images.append(img)
                out.append(img)
            elif random.random() > 0.5:
                idx = random.randint(0, self.size - 1)
                out.append(self.images[idx].clone())
                self.images[idx] = img
            else:
                out.append(img)
        return torch.cat(out, 0)


def init_weights(m):
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def set_requires_grad(nets, flag):
    for net in nets:
        for p in net.parameters():
            p.requires_grad = flag


@torch.no_grad()
def translate_test(netG, root, out_dir, crop_size, device, max_n=20):
    """用 testA 的前几张图看效果"""
    tf = T.Compose([T.Resize(crop_size, T.InterpolationMode.BICUBIC), T.CenterCrop(crop_size),
                    T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    paths = sorted(glob.glob(os.path.join(root, "testA", "*")))[:max_n]
    if not paths:
        return
    netG.eval()
    x = torch.stack([tf(Image.open(p).convert("RGB")) for p in paths]).to(device)
    y = torch.cat([netG(x[i:i + 4]) for i in range(0, len(x), 4)])
    netG.train()
    save_image(torch.cat([x, y]) * 0.5 + 0.5, out_dir, nrow=len(paths))


def main():
    opt = get_opt()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    save_dir = os.path.join(opt.checkpoints_dir, opt.name)
    if rank == 0:
        os.makedirs(os.path.join(save_dir, "images"), exist_ok=True)

    dataset = UnalignedDataset(opt.dataroot, opt.load_size, opt.crop_size)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=opt.batch_size, sampler=sampler,
                        num_workers=opt.num_threads, drop_last=True, pin_memory=True)
    if rank == 0:
        print("训练图片数 = %d, 每卡每 epoch %d iter" % (len(dataset), len(loader)))

    torch.manual_seed(0)  # 初始化权重各卡一致 (DDP 也会从 rank0 广播)
    nets = [resnet_generator(), resnet_generator(), patch_discriminator(), patch_discriminator()]
    for n in nets:
        n.apply(init_weights)
    netG_A, netG_B, netD_A, netD_B = [DDP(n.to(device), device_ids=[local_rank]) for n in nets]
    random.seed(rank)

    optG = torch.optim.Adam(itertools.chain(netG_A.parameters(), netG_B.parameters()), lr=opt.lr, betas=(0.5, 0.999))
    optD = torch.optim.Adam(itertools.chain(netD_A.parameters(), netD_B.parameters()), lr=opt.lr, betas=(0.5, 0.999))
    total = opt.n_epochs + opt.n_epochs_decay
    rule = lambda e: 1.0 - max(0, e + 1 - opt.n_epochs) / float(opt.n_epochs_decay + 1)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, rule) for o in (optG, optD)]
    gan_loss, l1 = nn.MSELoss(), nn.L1Loss()
    pool_A, pool_B = ImagePool(opt.pool_size), ImagePool(opt.pool_size)

    for epoch in range(total):
        for i, (real_A, real_B) in enumerate(loader):
            real_A, real_B = real_A.to(device, non_blocking=True), real_B.to(device, non_blocking=True)
            # ---------------- G_A and G_B ----------------
            set_requires_grad([netD_A, netD_B], False)
            optG.zero_grad()
            fake_B, fake_A = netG_A(real_A), netG_B(real_B)
            rec_A, rec_B = netG_B(fake_B), netG_A(fake_A)
            idt_A, idt_B = netG_A(real_B), netG_B(real_A)
            # G 这一步不需要同步 D 的梯度, 直接用 .module
            pred_fb, pred_fa = netD_A.module(fake_B), netD_B.module(fake_A)
            loss_G = gan_loss(pred_fb, torch.ones_like(pred_fb)) + gan_loss(pred_fa, torch.ones_like(pred_fa)) \
                + opt.lambda_cyc * (l1(rec_A, real_A) + l1(rec_B, real_B)) \
                + opt.lambda_cyc * opt.lambda_idt * (l1(idt_A, real_B) + l1(idt_B, real_A))
            loss_G.backward()
            optG.step()
            # ---------------- D_A and D_B ----------------
            set_requires_grad([netD_A, netD_B], True)
            optD.zero_grad()
            fb, fa = pool_B.query(fake_B.detach()), pool_A.query(fake_A.detach())
            pr, pf = netD_A(real_B), netD_A(fb)
            loss_D_A = 0.5 * (gan_loss(pr, torch.ones_like(pr)) + gan_loss(pf, torch.zeros_like(pf)))
            pr, pf = netD_B(real_A), netD_B(fa)
            loss_D_B = 0.5 * (gan_loss(pr, torch.ones_like(pr)) + gan_loss(pf, torch.zeros_like(pf)))
            (loss_D_A + loss_D_B).backward()
            optD.step()

            if i % 100 == 0:
                losses = torch.stack([loss_G.detach(), loss_D_A.detach(), loss_D_B.detach()])
                dist.all_reduce(losses)
                losses /= world_size
                if rank == 0:
                    print("(epoch: %d, iters: %d) G: %.3f D_A: %.3f D_B: %.3f" % (epoch, i, *losses.tolist()))
            if rank == 0 and i % opt.display_freq == 0:
                vis = torch.cat([real_A[:1], fake_B[:1], rec_A[:1], real_B[:1], fake_A[:1], rec_B[:1]])
                save_image(vis * 0.5 + 0.5, os.path.join(save_dir, "images", "ep%03d_%05d.png" % (epoch, i)), nrow=3)

        for s in schedulers:
            s.step()
        if rank == 0:
            state = {k: n.module.state_dict() for k, n in
                     zip(["G_A", "G_B", "D_A", "D_B"], [netG_A, netG_B, netD_A, netD_B])}
            torch.save(state, os.path.join(save_dir, "latest_net.pth"))
            if (epoch + 1) % 5 == 0:
                torch.save(state, os.path.join(save_dir, "%d_net.pth" % (epoch + 1)))
                translate_test(netG_A.module, opt.dataroot,
                               os.path.join(save_dir, "images", "test_ep%03d.png" % epoch), opt.crop_size, device)
            print("End of epoch %d / %d, lr = %.7f" % (epoch, total, optG.param_groups[0]["lr"]))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
