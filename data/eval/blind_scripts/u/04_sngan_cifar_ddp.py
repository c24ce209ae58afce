"""
Conditional SNGAN (hinge loss, projection discriminator) on CIFAR-10.
Multi-GPU with DDP, e.g.

    python -m torch.distributed.run --nproc_per_node=4 04_sngan_cifar_ddp.py --out runs/sngan_c10

FID is computed offline from the saved sample grids / generator checkpoints.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import spectral_norm as SN
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision
import torchvision.transforms as T
from torchvision.utils import save_image


class CondBN(nn.Module):
    def __init__(self, ch, n_cls):
        super().__init__()
        self.bn = nn.BatchNorm2d(ch, affine=False)
        self.gamma = nn.Embedding(n_cls, ch)
        self.beta = nn.Embedding(n_cls, ch)
        nn.init.ones_(self.gamma.weight)
        nn.init.zeros_(self.beta.weight)

    def forward(self, x, y):
        return self.bn(x) * self.gamma(y)[:, :, None, None] + self.beta(y)[:, :, None, None]


class GBlock(nn.Module):
    def __init__(self, cin, cout, n_cls):
        super().__init__()
        self.bn1 = CondBN(cin, n_cls)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.bn2 = CondBN(cout, n_cls)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.sc = nn.Conv2d(cin, cout, 1)

    def forward(self, x, y):
        h = F.interpolate(F.relu(self.bn1(x, y)), scale_factor=2)
        h = self.conv2(F.relu(self.bn2(self.conv1(h), y)))
        return h + self.sc(F.interpolate(x, scale_factor=2))


class Generator(nn.Module):
    def __init__(self, z_dim=128, ch=256, n_cls=10):
        super().__init__()
        self.z_dim, self.ch, self.n_cls = z_dim, ch, n_cls
        self.fc = nn.Linear(z_dim, 4 * 4 * ch)
        self.blocks = nn.ModuleList([GBlock(ch, ch, n_cls) for _ in range(3)])
        self.out = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, 3, 3, 1, 1), nn.Tanh())

    def forward(self, z, y):
        h = self.fc(z).view(-1, self.ch, 4, 4)
        for b in self.blocks:
            h = b(h, y)
        return self.out(h)

    @torch.no_grad()
    def sample(self, n, device, y=None):
        z = torch.randn(n, self.z_dim, device=device)
        if y is None:
            y = torch.arange(n, device=device) % self.n_cls
        return self.forward(z, y)


class DBlock(nn.Module):
    def __init__(self, cin, cout, down=True, first=False):
        super().__init__()
        self.c1 = SN(nn.Conv2d(cin, cout, 3, 1, 1))
        self.c2 = SN(nn.Conv2d(cout, cout, 3, 1, 1))
        self.sc = SN(nn.Conv2d(cin, cout, 1))
        self.down, self.first = down, first

    def forward(self, x):
        h = x if self.first else F.relu(x)
        h = self.c2(F.relu(self.c1(h)))
        s = self.sc(x)
        if self.down:
            h, s = F.avg_pool2d(h, 2), F.avg_pool2d(s, 2)
        return h + s


class Discriminator(nn.Module):
    def __init__(self, ch=128, n_cls=10):
        super().__init__()
        self.blocks = nn.Sequential(DBlock(3, ch, first=True), DBlock(ch, ch), DBlock(ch, ch, down=False),
                                    DBlock(ch, ch, down=False))
        self.lin = SN(nn.Linear(ch, 1))
        self.emb = SN(nn.Embedding(n_cls, ch))

    def forward(self, x, y):
        h = F.relu(self.blocks(x)).sum(dim=(2, 3))
        return self.lin(h).squeeze(1) + (self.emb(y) * h).sum(1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument('--data', default='./data')
    ap.add_argument('--out', default='runs/sngan_c10')
    ap.add_argument('--z_dim', type=int, default=128)
    ap.add_argument('--batch', type=int, default=64, help='per-GPU batch')
    ap.add_argument('--n_dis', type=int, default=5)
    ap.add_argument('--total_g_steps', type=int, default=50000)
    ap.add_argument('--lr_g', type=float, default=2e-4)
    ap.add_argument('--lr_d', type=float, default=2e-4)
    ap.add_argument('--sample_every', type=int, default=1000)
    ap.add_argument('--ckpt_every', type=int, default=5000)
    ap.add_argument('--resume', default='')
    return ap.parse_args()


def infinite(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for batch in loader:
            yield batch
        ep += 1


def main():
    args = parse()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank = dist.get_rank()
    dev = torch.device('cuda', local_rank)
    torch.manual_seed(0)

    tf = T.Compose([T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
    dist.barrier()
    ds = torchvision.datasets.CIFAR10(args.data, train=True, transform=tf, download=False)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, drop_last=True, pin_memory=True)
    data_iter = infinite(loader, sampler)

    G = Generator(args.z_dim).to(dev)
    D = Discriminator().to(dev)
    G = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(G), device_ids=[local_rank])
    D = DDP(D, device_ids=[local_rank])
    opt_g = torch.optim.Adam(G.parameters(), args.lr_g, betas=(0.0, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), args.lr_d, betas=(0.0, 0.9))

    step = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=dev)
        G.module.load_state_dict(ck['G'])
        D.module.load_state_dict(ck['D'])
        opt_g.load_state_dict(ck['opt_g'])
        opt_d.load_state_dict(ck['opt_d'])
        step = ck['step']

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.out, 'samples'), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, 'tb'))

    t0 = time.time()
    while step < args.total_g_steps:
        # ---- discriminator ----
        for _ in range(args.n_dis):
            x, y = next(data_iter)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            z = torch.randn(x.size(0), args.z_dim, device=dev)
            with torch.no_grad():
                fake = G(z, y)
            # real and fake in one forward so the SN buffers are touched once per backward
            d_out = D(torch.cat([x, fake]), torch.cat([y, y]))
            d_real, d_fake = d_out.chunk(2)
            loss_d = F.relu(1. - d_real).mean() + F.relu(1. + d_fake).mean()
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

        # ---- generator ----
        z = torch.randn(args.batch * 2, args.z_dim, device=dev)
        y_fake = torch.randint(0, 10, (args.batch * 2,), device=dev)
        loss_g = -D(G(z, y_fake), y_fake).mean()
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        step += 1

        if step % 100 == 0:
            losses = torch.stack([loss_d.detach(), loss_g.detach()])
            dist.all_reduce(losses)
            losses /= dist.get_world_size()
            if rank == 0:
                print(f'step {step} loss_d {losses[0]:.3f} loss_g {losses[1]:.3f} ({time.time() - t0:.1f}s)')
                writer.add_scalar('loss/d', losses[0].item(), step)
                writer.add_scalar('loss/g', losses[1].item(), step)
                t0 = time.time()

        if rank == 0 and step % args.sample_every == 0:
            G.eval()
            imgs = G.sample(100, dev)
            G.train()
            save_image(imgs * 0.5 + 0.5, os.path.join(args.out, 'samples', f'{step:06d}.png'), nrow=10)
            writer.add_images('samples', imgs[:32] * 0.5 + 0.5, step)

        if rank == 0 and step % args.ckpt_every == 0:
            torch.save({'G': G.module.state_dict(), 'D': D.module.state_dict(), 'opt_g': opt_g.state_dict(),
                        'opt_d': opt_d.state_dict(), 'step': step},
                       os.path.join(args.out, f'ckpt_{step:06d}.pt'))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
