"""SNGAN (ResNet, hinge loss, n_dis=5) on CIFAR-10 with DistributedDataParallel.

torchrun --nproc_per_node=2 train_sngan.py --data ./data --logdir logs/sngan_cifar10
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch_gan_metrics import get_inception_score_and_fid
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.utils import save_image


class GenBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.residual = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(), nn.Upsample(scale_factor=2),
            nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1))
        self.shortcut = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(cin, cout, 1))

    def forward(self, x):
        return self.residual(x) + self.shortcut(x)


class ResGenerator32(nn.Module):
    def __init__(self, z_dim=128, ch=256):
        super().__init__()
        self.z_dim, self.ch = z_dim, ch
        self.linear = nn.Linear(z_dim, 4 * 4 * ch)
        self.blocks = nn.Sequential(GenBlock(ch, ch), GenBlock(ch, ch), GenBlock(ch, ch))
        self.output = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, 3, 3, 1, 1), nn.Tanh())

    def forward(self, z):
        return self.output(self.blocks(self.linear(z).view(-1, self.ch, 4, 4)))


class OptimizedDisBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.shortcut = nn.Sequential(nn.AvgPool2d(2), spectral_norm(nn.Conv2d(cin, cout, 1)))
        self.residual = nn.Sequential(spectral_norm(nn.Conv2d(cin, cout, 3, 1, 1)), nn.ReLU(),
                                      spectral_norm(nn.Conv2d(cout, cout, 3, 1, 1)), nn.AvgPool2d(2))

    def forward(self, x):
        return self.residual(x) + self.shortcut(x)


class DisBlock(nn.Module):
    def __init__(self, cin, cout, down=False):
        super().__init__()
        sc = []
        if cin != cout or down:
            sc.append(spectral_norm(nn.Conv2d(cin, cout, 1)))
        if down:
            sc.append(nn.AvgPool2d(2))
        self.shortcut = nn.Sequential(*sc)
        res = [nn.ReLU(), spectral_norm(nn.Conv2d(cin, cout, 3, 1, 1)), nn.ReLU(),
               spectral_norm(nn.Conv2d(cout, cout, 3, 1, 1))]
        if down:
            res.append(nn.AvgPool2d(2))
        self.residual = nn.Sequential(*res)

    def forward(self, x):
        return self.residual(x) + self.shortcut(x)


class ResDiscriminator32(nn.Module):
    def __init__(self, ch=128):
        super().__init__()
        self.model = nn.Sequential(OptimizedDisBlock(3, ch), DisBlock(ch, ch, down=True),
                                   DisBlock(ch, ch), DisBlock(ch, ch), nn.ReLU())
        self.linear = spectral_norm(nn.Linear(ch, 1))

    def forward(self, x):
        return self.linear(self.model(x).sum(dim=[2, 3]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--logdir", default="logs/sngan_cifar10")
    ap.add_argument("--batch_size", type=int, default=64, help="per GPU")
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--n_dis", type=int, default=5)
    ap.add_argument("--lr_G", type=float, default=2e-4)
    ap.add_argument("--lr_D", type=float, default=2e-4)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--eval_every", type=int, default=10, help="epochs")
    ap.add_argument("--fid_cache", default="./stats/cifar10.train.npz")
    ap.add_argument("--num_images", type=int, default=50000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
        os.makedirs(args.logdir, exist_ok=True)
    dist.barrier()
    dataset = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]))
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    torch.manual_seed(args.seed)
    net_G = ResGenerator32().to(device)
    net_D = ResDiscriminator32().to(device)
    ema_G = copy.deepcopy(net_G).eval().requires_grad_(False)
    torch.manual_seed(args.seed + rank)

    net_G = DDP(net_G, device_ids=[local_rank])
    net_D = DDP(net_D, device_ids=[local_rank])
    optim_G = torch.optim.Adam(net_G.parameters(), lr=args.lr_G, betas=(0.0, 0.9))
    optim_D = torch.optim.Adam(net_D.parameters(), lr=args.lr_D, betas=(0.0, 0.9))
    total_G_steps = args.epochs * len(loader) // args.n_dis
    sched_G = torch.optim.lr_scheduler.LambdaLR(optim_G, lambda s: 1 - s / total_G_steps)
    sched_D = torch.optim.lr_scheduler.LambdaLR(optim_D, lambda s: 1 - s / total_G_steps)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    fixed_z = torch.randn(100, 128, device=device)
    g_step = 0

    for epoch in range(args.epochs):
        net_G.train()
        net_D.train()
        for i, (real, _) in enumerate(loader):
            real = real.to(device, non_blocking=True)
            z = torch.randn(real.size(0), 128, device=device)
            with torch.no_grad():
                fake = net_G(z)
            net_D_out = net_D(torch.cat([real, fake]))
            d_real, d_fake = net_D_out.split(real.size(0))
            loss_D = F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()
            optim_D.zero_grad(set_to_none=True)
            loss_D.backward()
            optim_D.step()

            if (i + 1) % args.n_dis != 0:
                continue

            for p in net_D.parameters():
                p.requires_grad_(False)
            z = torch.randn(args.batch_size * 2, 128, device=device)
            loss_G = -net_D(net_G(z)).mean()
            optim_G.zero_grad(set_to_none=True)
            loss_G.backward()
            optim_G.step()
            for p in net_D.parameters():
                p.requires_grad_(True)
            sched_G.step()
            sched_D.step()
            g_step += 1

            with torch.no_grad():
                for pe, p in zip(ema_G.parameters(), net_G.module.parameters()):
                    pe.mul_(args.ema).add_(p, alpha=1 - args.ema)
                for be, b in zip(ema_G.buffers(), net_G.module.buffers()):
                    be.copy_(b)

            if g_step % 100 == 0:
                l = torch.stack([loss_D.detach(), loss_G.detach()])
                dist.all_reduce(l)
                l /= world
                if rank == 0:
                    writer.add_scalar("loss/D", l[0].item(), g_step)
                    writer.add_scalar("loss/G", l[1].item(), g_step)
                    writer.add_scalar("lr/G", sched_G.get_last_lr()[0], g_step)

        if (epoch + 1) % args.eval_every == 0:
            if rank == 0:
                with torch.no_grad():
                    imgs = torch.cat([(ema_G(torch.randn(500, 128, device=device)) + 1) / 2
                                      for _ in range(args.num_images // 500)])
                    (IS, IS_std), FID = get_inception_score_and_fid(imgs, args.fid_cache, verbose=False)
                    save_image((ema_G(fixed_z) + 1) / 2, os.path.join(args.logdir, f"ema_{epoch + 1:04d}.png"), nrow=10)
                writer.add_scalar("IS", IS, epoch + 1)
                writer.add_scalar("FID", FID, epoch + 1)
                torch.save({"net_G": net_G.module.state_dict(), "net_D": net_D.module.state_dict(),
                            "ema_G": ema_G.state_dict(), "optim_G": optim_G.state_dict(),
                            "optim_D": optim_D.state_dict(), "epoch": epoch + 1},
                           os.path.join(args.logdir, "model.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
