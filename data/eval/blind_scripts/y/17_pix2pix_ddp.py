"""pix2pix (U-Net generator + 70x70 PatchGAN) for paired image translation,
multi-GPU with torchrun. Aligned datasets: each file is A|B side by side.

    torchrun --nproc_per_node=4 pix2pix_ddp.py --dataroot datasets/maps --name maps_p2p
    torchrun --nproc_per_node=4 pix2pix_ddp.py --dataroot datasets/maps --name maps_p2p --resume checkpoints/maps_p2p/latest.pth
"""
import argparse
import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image


class AlignedDataset(Dataset):
    def __init__(self, root, phase, load_size=286, crop=256, train=True):
        self.paths = sorted(glob.glob(os.path.join(root, phase, "*.jpg")))
        self.load_size, self.crop, self.train = load_size, crop, train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        ab = Image.open(self.paths[i]).convert("RGB")
        w, h = ab.size
        a, b = ab.crop((0, 0, w // 2, h)), ab.crop((w // 2, 0, w, h))
        if self.train:
            a, b = TF.resize(a, [self.load_size] * 2), TF.resize(b, [self.load_size] * 2)
            x = torch.randint(0, self.load_size - self.crop + 1, (1,)).item()
            y = torch.randint(0, self.load_size - self.crop + 1, (1,)).item()
            a, b = TF.crop(a, y, x, self.crop, self.crop), TF.crop(b, y, x, self.crop, self.crop)
            if torch.rand(1).item() < 0.5:
                a, b = TF.hflip(a), TF.hflip(b)
        else:
            a, b = TF.resize(a, [self.crop] * 2), TF.resize(b, [self.crop] * 2)
        norm = lambda t: TF.normalize(TF.to_tensor(t), [0.5] * 3, [0.5] * 3)
        return norm(a), norm(b)


class UNetBlock(nn.Module):
    def __init__(self, outer, inner, sub=None, outermost=False, innermost=False, dropout=False):
        super().__init__()
        self.outermost = outermost
        down = [nn.LeakyReLU(0.2, True), nn.Conv2d(outer if not outermost else 3, inner, 4, 2, 1)]
        if outermost:
            down = [nn.Conv2d(3, inner, 4, 2, 1)]
            up = [nn.ReLU(True), nn.ConvTranspose2d(inner * 2, 3, 4, 2, 1), nn.Tanh()]
            layers = down + [sub] + up
        elif innermost:
            up = [nn.ReLU(True), nn.ConvTranspose2d(inner, outer, 4, 2, 1), nn.InstanceNorm2d(outer)]
            layers = down + up
        else:
            down += [nn.InstanceNorm2d(inner)]
            up = [nn.ReLU(True), nn.ConvTranspose2d(inner * 2, outer, 4, 2, 1), nn.InstanceNorm2d(outer)]
            layers = down + [sub] + up + ([nn.Dropout(0.5)] if dropout else [])
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x) if self.outermost else torch.cat([x, self.model(x)], 1)


def unet_generator(ngf=64):
    blk = UNetBlock(ngf * 8, ngf * 8, innermost=True)
    for _ in range(3):
        blk = UNetBlock(ngf * 8, ngf * 8, blk, dropout=True)
    blk = UNetBlock(ngf * 4, ngf * 8, blk)
    blk = UNetBlock(ngf * 2, ngf * 4, blk)
    blk = UNetBlock(ngf, ngf * 2, blk)
    return UNetBlock(3, ngf, blk, outermost=True)


def patch_discriminator(ndf=64):
    return nn.Sequential(
        nn.Conv2d(6, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf, ndf * 2, 4, 2, 1), nn.InstanceNorm2d(ndf * 2), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1), nn.InstanceNorm2d(ndf * 4), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 4, ndf * 8, 4, 1, 1), nn.InstanceNorm2d(ndf * 8), nn.LeakyReLU(0.2, True),
        nn.Conv2d(ndf * 8, 1, 4, 1, 1))


def init_weights(m):
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        nn.init.zeros_(m.bias)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataroot", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--checkpoints_dir", default="checkpoints")
    ap.add_argument("--batch_size", type=int, default=4, help="per GPU")
    ap.add_argument("--n_epochs", type=int, default=100)
    ap.add_argument("--n_epochs_decay", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lambda_L1", type=float, default=100.0)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    save_dir = os.path.join(args.checkpoints_dir, args.name)

    train_ds = AlignedDataset(args.dataroot, "train")
    val_ds = AlignedDataset(args.dataroot, "val", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=8, num_workers=2)

    netG = unet_generator().to(device)
    netD = patch_discriminator().to(device)
    netG.apply(init_weights)
    netD.apply(init_weights)
    optG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
    start_epoch = 1
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        netG.load_state_dict(ckpt["G"])
        netD.load_state_dict(ckpt["D"])
        optG.load_state_dict(ckpt["optG"])
        optD.load_state_dict(ckpt["optD"])
        start_epoch = ckpt["epoch"] + 1

    netG = DDP(netG, device_ids=[local_rank])
    netD = DDP(netD, device_ids=[local_rank])

    def lambda_rule(epoch):
        return 1.0 - max(0, epoch + 1 - args.n_epochs) / float(args.n_epochs_decay + 1)
    schedG = torch.optim.lr_scheduler.LambdaLR(optG, lambda_rule, last_epoch=start_epoch - 2)
    schedD = torch.optim.lr_scheduler.LambdaLR(optD, lambda_rule, last_epoch=start_epoch - 2)
    gan_loss = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.n_epochs + args.n_epochs_decay + 1):
        sampler.set_epoch(epoch)
        meter = torch.zeros(4, device=device)
        for i, (real_A, real_B) in enumerate(loader):
            real_A, real_B = real_A.to(device, non_blocking=True), real_B.to(device, non_blocking=True)
            fake_B = netG(real_A)

            # D: real pairs -> 1, fake pairs -> 0
            optD.zero_grad(set_to_none=True)
            pred_fake = netD(torch.cat([real_A, fake_B.detach()], 1))
            pred_real = netD(torch.cat([real_A, real_B], 1))
            loss_D = 0.5 * (gan_loss(pred_fake, torch.zeros_like(pred_fake)) +
                            gan_loss(pred_real, torch.ones_like(pred_real)))
            loss_D.backward()
            optD.step()

            # G: fool D and stay close to the target in L1
            optG.zero_grad(set_to_none=True)
            pred_fake = netD(torch.cat([real_A, fake_B], 1))
            loss_G_GAN = gan_loss(pred_fake, torch.ones_like(pred_fake))
            loss_G_L1 = F.l1_loss(fake_B, real_B) * args.lambda_L1
            loss_G = loss_G_GAN + loss_G_L1
            loss_G.backward()
            optG.step()

            meter += torch.stack([loss_D.detach(), loss_G_GAN.detach(), loss_G_L1.detach(),
                                  torch.ones((), device=device)])
        schedG.step()
        schedD.step()

        # validation L1 on the held-out pairs
        netG.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for j, (a, b) in enumerate(val_loader):
                a, b = a.to(device), b.to(device)
                out = netG.module(a)
                val += torch.stack([F.l1_loss(out, b, reduction="sum") / out[0].numel(),
                                    torch.tensor(float(a.size(0)), device=device)])
                if j == 0 and rank == 0:
                    save_image(torch.cat([a, out, b], 3) * 0.5 + 0.5, os.path.join(save_dir, f"val_ep{epoch:03d}.png"))
        netG.train()
        dist.all_reduce(meter)
        dist.all_reduce(val)
        if rank == 0:
            d, gg, l1, n = (meter / meter[3]).tolist()
            print(f"epoch {epoch} D {d:.3f} G_GAN {gg:.3f} G_L1 {l1:.3f} val_L1 {(val[0] / val[1]).item():.4f} "
                  f"lr {schedG.get_last_lr()[0]:.2e}", flush=True)
            state = {"G": netG.state_dict(), "D": netD.state_dict(), "optG": optG.state_dict(),
                     "optD": optD.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(save_dir, "latest.pth"))
            if epoch % 20 == 0:
                torch.save(state, os.path.join(save_dir, f"epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
