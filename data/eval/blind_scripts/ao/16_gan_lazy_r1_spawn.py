"""
Residual GAN with a mapping network, non-saturating loss, lazy R1 regularisation
(every `d_reg_every` steps, StyleGAN2 style) and an EMA generator.

Single node, spawned workers:
    python gan_r1.py --data /data/afhq/cat --world_size 4 --out runs/afhqcat
"""
import argparse
import copy
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import autograd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


class Mapping(nn.Module):
    def __init__(self, z=512, w=512, n=4):
        super().__init__()
        L = []
        for i in range(n):
            L += [nn.Linear(z if i == 0 else w, w), nn.LeakyReLU(0.2)]
        self.net = nn.Sequential(*L)

    def forward(self, z):
        return self.net(F.normalize(z, dim=1) * math.sqrt(z.shape[1]))


class AdaBlock(nn.Module):
    def __init__(self, ci, co, w):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(ci, co, 3, 1, 1), nn.Conv2d(co, co, 3, 1, 1)
        self.s1, self.s2 = nn.Linear(w, 2 * ci), nn.Linear(w, 2 * co)
        self.skip = nn.Conv2d(ci, co, 1)

    @staticmethod
    def adain(x, style):
        g, b = style[:, :, None, None].chunk(2, 1)
        return F.instance_norm(x) * (1 + g) + b

    def forward(self, x, w):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        h = self.c1(F.leaky_relu(self.adain(x, self.s1(w)), 0.2))
        h = self.c2(F.leaky_relu(self.adain(h, self.s2(w)), 0.2))
        return (h + self.skip(x)) / math.sqrt(2)


class Generator(nn.Module):
    def __init__(self, res=256, zdim=512):
        super().__init__()
        self.zdim = zdim
        self.map = Mapping(zdim)
        self.const = nn.Parameter(torch.randn(1, 512, 4, 4))
        ch = {8: 512, 16: 512, 32: 512, 64: 256, 128: 128, 256: 64}
        self.blocks, c, r = nn.ModuleList(), 512, 8
        while r <= res:
            self.blocks.append(AdaBlock(c, ch[r], 512))
            c, r = ch[r], r * 2
        self.to_rgb = nn.Conv2d(c, 3, 1)

    def forward(self, z):
        w = self.map(z)
        x = self.const.expand(z.shape[0], -1, -1, -1)
        for b in self.blocks:
            x = b(x, w)
        return self.to_rgb(x)


class Discriminator(nn.Module):
    def __init__(self, res=256):
        super().__init__()
        ch = {256: 64, 128: 128, 64: 256, 32: 512, 16: 512, 8: 512, 4: 512}
        L, r = [nn.Conv2d(3, ch[res], 1), nn.LeakyReLU(0.2)], res
        while r > 4:
            L += [nn.Conv2d(ch[r], ch[r // 2], 3, 1, 1), nn.LeakyReLU(0.2), nn.AvgPool2d(2)]
            r //= 2
        self.body = nn.Sequential(*L)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(512 * 16, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))

    def forward(self, x):
        return self.head(self.body(x))


def d_r1(real_pred, real_img):
    (grad,) = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad.pow(2).reshape(grad.shape[0], -1).sum(1).mean()


def requires_grad(m, flag):
    for p in m.parameters():
        p.requires_grad = flag


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank); np.random.seed(args.seed + rank); torch.manual_seed(args.seed + rank)

    tf = transforms.Compose([transforms.Resize(args.res), transforms.CenterCrop(args.res),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    G, D = Generator(args.res).to(device), Discriminator(args.res).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    d_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_opt = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0, 0.99))
    d_opt = torch.optim.Adam(D.parameters(), lr=args.lr * d_ratio, betas=(0, 0.99 ** d_ratio))
    step = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ck["G"]); D.load_state_dict(ck["D"]); G_ema.load_state_dict(ck["G_ema"])
        g_opt.load_state_dict(ck["g_opt"]); d_opt.load_state_dict(ck["d_opt"]); step = ck["step"]
    G = DDP(G, device_ids=[rank])
    D = DDP(D, device_ids=[rank])
    if not args.resume:
        G_ema.load_state_dict(G.module.state_dict())

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        fixed_z = torch.randn(36, args.zdim, device=device, generator=torch.Generator(device=device).manual_seed(0))
    ema_beta = 0.5 ** (args.batch * world_size / (10 * 1000))
    epoch, t0 = step // len(loader), time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for real, _ in loader:
            real = real.to(device, non_blocking=True)

            # ---- D
            requires_grad(G, False); requires_grad(D, True)
            z = torch.randn(real.size(0), args.zdim, device=device)
            fake = G(z)
            d_loss = F.softplus(D(fake)).mean() + F.softplus(-D(real)).mean()
            d_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            d_opt.step()

            if step % args.d_reg_every == 0:
                real.requires_grad_(True)
                real_pred = D(real)
                r1 = d_r1(real_pred, real)
                d_opt.zero_grad(set_to_none=True)
                (args.r1 / 2 * r1 * args.d_reg_every + 0 * real_pred[0]).sum().backward()
                d_opt.step()
                real.requires_grad_(False)

            # ---- G
            requires_grad(G, True); requires_grad(D, False)
            z = torch.randn(real.size(0), args.zdim, device=device)
            g_loss = F.softplus(-D(G(z))).mean()
            g_opt.zero_grad(set_to_none=True)
            g_loss.backward()
            g_opt.step()

            with torch.no_grad():
                for pe, p in zip(G_ema.parameters(), G.module.parameters()):
                    pe.copy_(p.lerp(pe, ema_beta))

            step += 1
            if step % 100 == 0:
                s = torch.stack([d_loss.detach(), g_loss.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} d {s[0]:.3f} g {s[1]:.3f} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                    t0 = time.time()
            if step % args.snap_every == 0:
                if rank == 0:
                    with torch.no_grad():
                        save_image(G_ema(fixed_z), os.path.join(args.out, f"fakes_{step:07d}.png"), nrow=6,
                                   normalize=True, value_range=(-1, 1))
                    torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                                "g_opt": g_opt.state_dict(), "d_opt": d_opt.state_dict(), "step": step},
                               os.path.join(args.out, f"snap_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/gan_r1")
    p.add_argument("--res", type=int, default=256)
    p.add_argument("--zdim", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--r1", type=float, default=10.0)
    p.add_argument("--d_reg_every", type=int, default=16)
    p.add_argument("--steps", type=int, default=500_000)
    p.add_argument("--snap_every", type=int, default=5000)
    p.add_argument("--world_size", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
