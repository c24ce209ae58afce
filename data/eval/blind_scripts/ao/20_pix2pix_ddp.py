"""
pix2pix (U-Net generator + 70x70 PatchGAN, LSGAN + L1) trained with DDP.
Aligned dataset: each file is A|B side by side, like the original repo.

    torchrun --nproc_per_node=4 train_pix2pix.py --dataroot datasets/facades --name facades_p2p --direction BtoA
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T
from torchvision.utils import save_image


class AlignedDataset(Dataset):
    def __init__(self, root, phase="train", load_size=286, crop_size=256, direction="AtoB"):
        d = os.path.join(root, phase)
        self.paths = sorted(os.path.join(d, f) for f in os.listdir(d) if f.lower().endswith((".jpg", ".png")))
        self.load_size, self.crop_size, self.direction = load_size, crop_size, direction
        self.norm = T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        ab = Image.open(self.paths[i]).convert("RGB")
        w, h = ab.size
        A, B = ab.crop((0, 0, w // 2, h)), ab.crop((w // 2, 0, w, h))
        A, B = A.resize((self.load_size,) * 2, Image.BICUBIC), B.resize((self.load_size,) * 2, Image.BICUBIC)
        i0, j0, hh, ww = T.RandomCrop.get_params(A, (self.crop_size, self.crop_size))
        A, B = A.crop((j0, i0, j0 + ww, i0 + hh)), B.crop((j0, i0, j0 + ww, i0 + hh))
        if torch.rand(1) < 0.5:
            A, B = A.transpose(Image.FLIP_LEFT_RIGHT), B.transpose(Image.FLIP_LEFT_RIGHT)
        A, B = self.norm(A), self.norm(B)
        return (A, B) if self.direction == "AtoB" else (B, A)


class UnetBlock(nn.Module):
    def __init__(self, outer, inner, sub=None, outermost=False, innermost=False, dropout=False):
        super().__init__()
        self.outermost = outermost
        down = [nn.LeakyReLU(0.2, True), nn.Conv2d(outer, inner, 4, 2, 1, bias=False)]
        if not outermost and not innermost:
            down.append(nn.InstanceNorm2d(inner))
        if outermost:
            down = down[1:]
        up_in = inner if innermost else inner * 2
        up = [nn.ReLU(True), nn.ConvTranspose2d(up_in, outer, 4, 2, 1, bias=outermost)]
        if outermost:
            up.append(nn.Tanh())
        else:
            up.append(nn.InstanceNorm2d(outer))
            if dropout:
                up.append(nn.Dropout(0.5))
        self.model = nn.Sequential(*down, *([sub] if sub is not None else []), *up)

    def forward(self, x):
        return self.model(x) if self.outermost else torch.cat([x, self.model(x)], 1)


def unet_generator(ngf=64, num_downs=8):
    b = UnetBlock(ngf * 8, ngf * 8, innermost=True)
    for _ in range(num_downs - 5):
        b = UnetBlock(ngf * 8, ngf * 8, b, dropout=True)
    b = UnetBlock(ngf * 4, ngf * 8, b)
    b = UnetBlock(ngf * 2, ngf * 4, b)
    b = UnetBlock(ngf, ngf * 2, b)
    return UnetBlock(3, ngf, b, outermost=True)


def patch_discriminator(in_ch=6, ndf=64):
    return nn.Sequential(
        nn.Conv2d(in_ch, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.InstanceNorm2d(ndf * 2), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.InstanceNorm2d(ndf * 4), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 4, ndf * 8, 4, 1, 1, bias=False), nn.InstanceNorm2d(ndf * 8), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 8, 1, 4, 1, 1))


def init_weights(m):
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def save_networks(netG, netD, optG, optD, epoch, save_dir):
    state = {"G": netG.module.state_dict(), "D": netD.module.state_dict(),
             "optG": optG.state_dict(), "optD": optD.state_dict(), "epoch": epoch}
    torch.save(state, os.path.join(save_dir, f"{epoch}_net.pth"))
    torch.save(state, os.path.join(save_dir, "latest_net.pth"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", required=True)
    p.add_argument("--name", default="p2p")
    p.add_argument("--checkpoints_dir", default="./checkpoints")
    p.add_argument("--direction", default="AtoB")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--n_epochs", type=int, default=100)
    p.add_argument("--n_epochs_decay", type=int, default=100)
    p.add_argument("--lambda_L1", type=float, default=100.0)
    p.add_argument("--save_epoch_freq", type=int, default=5)
    p.add_argument("--continue_train", action="store_true")
    opt = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    save_dir = os.path.join(opt.checkpoints_dir, opt.name)
    os.makedirs(os.path.join(save_dir, "web"), exist_ok=True)

    ds = AlignedDataset(opt.dataroot, direction=opt.direction)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=opt.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    netG, netD = unet_generator().to(device), patch_discriminator().to(device)
    netG.apply(init_weights); netD.apply(init_weights)
    optG = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(0.5, 0.999))
    start_epoch = 1
    latest = os.path.join(save_dir, "latest_net.pth")
    if opt.continue_train and os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        netG.load_state_dict(ck["G"]); netD.load_state_dict(ck["D"])
        optG.load_state_dict(ck["optG"]); optD.load_state_dict(ck["optD"])
        start_epoch = ck["epoch"] + 1
    netG = DDP(netG, device_ids=[local_rank])
    netD = DDP(netD, device_ids=[local_rank])

    def lambda_rule(ep):
        return 1.0 - max(0, ep + start_epoch - opt.n_epochs) / float(opt.n_epochs_decay + 1)
    schedG = torch.optim.lr_scheduler.LambdaLR(optG, lambda_rule)
    schedD = torch.optim.lr_scheduler.LambdaLR(optD, lambda_rule)
    gan_loss = nn.MSELoss()
    l1 = nn.L1Loss()

    for epoch in range(start_epoch, opt.n_epochs + opt.n_epochs_decay + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        meters = torch.zeros(3, device=device)
        for real_A, real_B in dl:
            real_A, real_B = real_A.to(device, non_blocking=True), real_B.to(device, non_blocking=True)
            fake_B = netG(real_A)

            # D: fake pairs and real pairs in one batch
            pred = netD(torch.cat([torch.cat([real_A, fake_B.detach()], 1), torch.cat([real_A, real_B], 1)]))
            pred_fake, pred_real = pred.chunk(2)
            loss_D = 0.5 * (gan_loss(pred_fake, torch.zeros_like(pred_fake)) +
                            gan_loss(pred_real, torch.ones_like(pred_real)))
            optD.zero_grad(set_to_none=True)
            loss_D.backward()
            optD.step()

            # G
            pred_fake = netD(torch.cat([real_A, fake_B], 1))
            loss_G_GAN = gan_loss(pred_fake, torch.ones_like(pred_fake))
            loss_G_L1 = l1(fake_B, real_B) * opt.lambda_L1
            optG.zero_grad(set_to_none=True)
            (loss_G_GAN + loss_G_L1).backward()
            optG.step()
            meters += torch.stack([loss_D.detach(), loss_G_GAN.detach(), loss_G_L1.detach()])

        schedG.step(); schedD.step()
        dist.all_reduce(meters)
        meters /= len(dl) * world
        if rank == 0:
            print(f"(epoch {epoch}, {time.time() - t0:.0f}s) D {meters[0]:.3f} G_GAN {meters[1]:.3f} "
                  f"G_L1 {meters[2]:.3f} lr {schedG.get_last_lr()[0]:.6f}", flush=True)
            save_image(torch.cat([real_A[:4], fake_B[:4].detach(), real_B[:4]]) * 0.5 + 0.5,
                       os.path.join(save_dir, "web", f"epoch{epoch:03d}.png"), nrow=4)
        if epoch % opt.save_epoch_freq == 0:
            save_networks(netG, netD, optG, optD, epoch, save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
