"""DCGAN-style generator + ResNet discriminator with hinge loss, trained on LSUN/CelebA-HQ crops.

    torchrun --standalone --nproc_per_node=4 train_gan.py --data /data/celeba_hq/images --out runs/celeba128
"""
import argparse
import copy
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.utils import save_image


class ImageDir(Dataset):
    def __init__(self, root, size):
        self.files = sorted(glob.glob(os.path.join(root, "*.jpg")) + glob.glob(os.path.join(root, "*.png")))
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                                      transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                      transforms.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB"))


class Generator(nn.Module):
    def __init__(self, nz=128, ngf=64, img_size=128):
        super().__init__()
        self.nz = nz
        self.init_size = img_size // 32
        self.fc = nn.Linear(nz, ngf * 16 * self.init_size ** 2)
        chans = [ngf * 16, ngf * 8, ngf * 4, ngf * 2, ngf, ngf]
        blocks = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            blocks += [nn.BatchNorm2d(cin), nn.ReLU(True), nn.Upsample(scale_factor=2),
                       nn.Conv2d(cin, cout, 3, 1, 1)]
        self.blocks = nn.Sequential(*blocks)
        self.to_rgb = nn.Sequential(nn.BatchNorm2d(ngf), nn.ReLU(True), nn.Conv2d(ngf, 3, 3, 1, 1), nn.Tanh())
        self.ngf = ngf

    def forward(self, z):
        x = self.fc(z).view(z.shape[0], self.ngf * 16, self.init_size, self.init_size)
        return self.to_rgb(self.blocks(x))


class DBlock(nn.Module):
    def __init__(self, cin, cout, down=True):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.sc = nn.Conv2d(cin, cout, 1)
        self.down = down

    def forward(self, x):
        h = self.c2(F.leaky_relu(self.c1(F.leaky_relu(x, 0.2)), 0.2))
        s = self.sc(x)
        if self.down:
            h, s = F.avg_pool2d(h, 2), F.avg_pool2d(s, 2)
        return h + s


class Discriminator(nn.Module):
    def __init__(self, ndf=64):
        super().__init__()
        chans = [3, ndf, ndf * 2, ndf * 4, ndf * 8, ndf * 16]
        self.blocks = nn.Sequential(*[DBlock(a, b) for a, b in zip(chans[:-1], chans[1:])],
                                    DBlock(ndf * 16, ndf * 16, down=False))
        self.fc = nn.Linear(ndf * 16, 1)

    def forward(self, x):
        h = F.leaky_relu(self.blocks(x), 0.2).sum(dim=(2, 3))
        return self.fc(h).squeeze(1)


@torch.no_grad()
def ema_update(ema, model, decay):
    for p_ema, p in zip(ema.parameters(), model.parameters()):
        p_ema.lerp_(p, 1 - decay)
    for b_ema, b in zip(ema.buffers(), model.buffers()):
        b_ema.copy_(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/gan")
    ap.add_argument("--img-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="per GPU")
    ap.add_argument("--iters", type=int, default=200000)
    ap.add_argument("--lr-g", type=float, default=1e-4)
    ap.add_argument("--lr-d", type=float, default=4e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--sample-every", type=int, default=2000)
    ap.add_argument("--ckpt-every", type=int, default=10000)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)

    dataset = ImageDir(args.data, args.img_size)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    G = Generator(img_size=args.img_size)
    G = nn.SyncBatchNorm.convert_sync_batchnorm(G).to(device)
    D = Discriminator().to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)

    optG = torch.optim.Adam(G.parameters(), lr=args.lr_g, betas=(0.0, 0.999))
    optD = torch.optim.Adam(D.parameters(), lr=args.lr_d, betas=(0.0, 0.999))
    start_iter = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ckpt["G"])
        D.load_state_dict(ckpt["D"])
        G_ema.load_state_dict(ckpt["G_ema"])
        optG.load_state_dict(ckpt["optG"])
        optD.load_state_dict(ckpt["optD"])
        start_iter = ckpt["iter"]

    netG = DDP(G, device_ids=[local_rank])
    netD = DDP(D, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    fixed_z = torch.randn(64, G.nz, device=device)

    epoch, it = 0, start_iter
    sampler.set_epoch(epoch)
    data_iter = iter(loader)
    t0 = time.time()
    while it < args.iters:
        try:
            real = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            real = next(data_iter)
        real = real.to(device, non_blocking=True)
        b = real.shape[0]

        # ---- D step
        z = torch.randn(b, netG.nz, device=device)
        fake = netG(z)
        d_out = netD(torch.cat([real, fake.detach()]))
        d_real, d_fake = d_out[:b], d_out[b:]
        loss_d = F.relu(1.0 - d_real).mean() + F.relu(1.0 + d_fake).mean()
        optD.zero_grad(set_to_none=True)
        loss_d.backward()
        optD.step()

        # ---- G step
        loss_g = -netD(fake).mean()
        optG.zero_grad(set_to_none=True)
        loss_g.backward()
        optG.step()
        ema_update(G_ema, G, args.ema)
        it += 1

        if it % 100 == 0:
            stats = torch.stack([loss_d.detach(), loss_g.detach(), d_real.mean().detach(), d_fake.mean().detach()])
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                print(f"[{it}/{args.iters}] D {stats[0]:.3f} G {stats[1]:.3f} "
                      f"D(x) {stats[2]:.3f} D(G(z)) {stats[3]:.3f} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

        if rank == 0 and it % args.sample_every == 0:
            with torch.no_grad():
                save_image(G_ema(fixed_z), os.path.join(args.out, "samples", f"{it:07d}.png"),
                           nrow=8, normalize=True, value_range=(-1, 1))
        if it % args.ckpt_every == 0:
            if rank == 0:
                torch.save({"G": G.state_dict(), "D": D.state_dict(), "G_ema": G_ema.state_dict(),
                            "optG": optG.state_dict(), "optD": optD.state_dict(), "iter": it},
                           os.path.join(args.out, f"ckpt_{it:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
