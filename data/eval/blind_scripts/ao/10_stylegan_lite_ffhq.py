# Minimal StyleGAN2-style generator (mapping net + modulated convs + noise) with a
# residual discriminator, non-saturating logistic loss and an EMA generator.
#
# Usage:
#   torchrun --nproc_per_node=4 train_stylegan_lite.py --data /data/ffhq128 --out runs/sg_lite_ffhq128
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


class EqLinear(nn.Module):
    def __init__(self, i, o, lr_mul=1.0, bias_init=0.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(o, i) / lr_mul)
        self.b = nn.Parameter(torch.full((o,), float(bias_init)))
        self.scale, self.lr_mul = lr_mul / math.sqrt(i), lr_mul

    def forward(self, x):
        return F.linear(x, self.w * self.scale, self.b * self.lr_mul)


class ModConv(nn.Module):
    def __init__(self, ci, co, k, wdim, demod=True, up=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(co, ci, k, k))
        self.affine = EqLinear(wdim, ci, bias_init=1.0)
        self.scale = 1 / math.sqrt(ci * k * k)
        self.demod, self.up, self.pad = demod, up, k // 2

    def forward(self, x, w):
        B, C, H, W = x.shape
        s = self.affine(w)
        wt = self.weight[None] * self.scale * s[:, None, :, None, None]
        if self.demod:
            wt = wt * torch.rsqrt(wt.pow(2).sum([2, 3, 4], keepdim=True) + 1e-8)
        if self.up:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            H, W = H * 2, W * 2
        x = x.reshape(1, B * C, H, W)
        out = F.conv2d(x, wt.reshape(-1, C, *wt.shape[3:]), padding=self.pad, groups=B)
        return out.reshape(B, -1, H, W)


class StyleLayer(nn.Module):
    def __init__(self, ci, co, wdim, up=False):
        super().__init__()
        self.conv = ModConv(ci, co, 3, wdim, up=up)
        self.noise_strength = nn.Parameter(torch.zeros(()))
        self.bias = nn.Parameter(torch.zeros(1, co, 1, 1))

    def forward(self, x, w):
        x = self.conv(x, w)
        x = x + self.noise_strength * torch.randn(x.shape[0], 1, x.shape[2], x.shape[3], device=x.device)
        return F.leaky_relu(x + self.bias, 0.2) * math.sqrt(2)


class Generator(nn.Module):
    def __init__(self, res=128, zdim=512, wdim=512, n_map=8, ch_max=512):
        super().__init__()
        self.zdim = zdim
        self.mapping = nn.Sequential(*[m for _ in range(n_map) for m in (EqLinear(zdim if _ == 0 else wdim, wdim, lr_mul=0.01), nn.LeakyReLU(0.2))])
        self.const = nn.Parameter(torch.randn(1, ch_max, 4, 4))
        chans = {4: ch_max, 8: ch_max, 16: ch_max, 32: ch_max, 64: 256, 128: 128, 256: 64}
        self.layers = nn.ModuleList([StyleLayer(ch_max, ch_max, wdim)])
        self.torgb = nn.ModuleList([ModConv(ch_max, 3, 1, wdim, demod=False)])
        r = 8
        while r <= res:
            self.layers.append(StyleLayer(chans[r // 2], chans[r], wdim, up=True))
            self.layers.append(StyleLayer(chans[r], chans[r], wdim))
            self.torgb.append(ModConv(chans[r], 3, 1, wdim, demod=False))
            r *= 2
        self.register_buffer("w_avg", torch.zeros(wdim))

    def forward(self, z, psi=1.0):
        w = self.mapping(F.normalize(z, dim=1) * math.sqrt(z.shape[1]))
        if self.training:
            self.w_avg.copy_(w.detach().mean(0).lerp(self.w_avg, 0.995))
        if psi != 1.0:
            w = self.w_avg.lerp(w, psi)
        x = self.layers[0](self.const.expand(z.shape[0], -1, -1, -1), w)
        img = self.torgb[0](x, w)
        for i in range(1, len(self.torgb)):
            x = self.layers[2 * i - 1](x, w)
            x = self.layers[2 * i](x, w)
            img = F.interpolate(img, scale_factor=2, mode="bilinear", align_corners=False) + self.torgb[i](x, w)
        return img


class DBlock(nn.Module):
    def __init__(self, ci, co):
        super().__init__()
        self.c1 = nn.Conv2d(ci, ci, 3, 1, 1)
        self.c2 = nn.Conv2d(ci, co, 3, 1, 1)
        self.skip = nn.Conv2d(ci, co, 1, bias=False)

    def forward(self, x):
        h = F.leaky_relu(self.c1(x), 0.2)
        h = F.avg_pool2d(F.leaky_relu(self.c2(h), 0.2), 2)
        return (h + F.avg_pool2d(self.skip(x), 2)) / math.sqrt(2)


class Discriminator(nn.Module):
    def __init__(self, res=128):
        super().__init__()
        chans = {128: 128, 64: 256, 32: 512, 16: 512, 8: 512, 4: 512}
        self.frgb = nn.Conv2d(3, chans[res], 1)
        blocks, r = [], res
        while r > 4:
            blocks.append(DBlock(chans[r], chans[r // 2]))
            r //= 2
        self.blocks = nn.Sequential(*blocks)
        self.final = nn.Sequential(nn.Conv2d(512, 512, 3, 1, 1), nn.LeakyReLU(0.2), nn.Flatten(),
                                   nn.Linear(512 * 16, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))

    def forward(self, x):
        return self.final(self.blocks(F.leaky_relu(self.frgb(x), 0.2)))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/sg_lite")
    p.add_argument("--res", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="batch per GPU")
    p.add_argument("--iters", type=int, default=400_000)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--ema_kimg", type=float, default=10.0)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--ckpt", default=None)
    return p.parse_args()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    G = Generator(res=args.res).to(device)
    D = Discriminator(res=args.res).to(device)
    G_ema = copy.deepcopy(G).eval()
    g_opt = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.0, 0.99), eps=1e-8)
    d_opt = torch.optim.Adam(D.parameters(), lr=args.lr, betas=(0.0, 0.99), eps=1e-8)
    start = 0
    if args.ckpt:
        ck = torch.load(args.ckpt, map_location=lambda s, l: s)
        G.load_state_dict(ck["g"]); D.load_state_dict(ck["d"]); G_ema.load_state_dict(ck["g_ema"])
        g_opt.load_state_dict(ck["g_opt"]); d_opt.load_state_dict(ck["d_opt"]); start = ck["iter"]

    G = DDP(G, device_ids=[args.local_rank], broadcast_buffers=False)
    D = DDP(D, device_ids=[args.local_rank], broadcast_buffers=False)

    tf = transforms.Compose([transforms.Resize(args.res), transforms.CenterCrop(args.res),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    def sample_data():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for x, _ in loader:
                yield x
            epoch += 1

    data = sample_data()
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        sample_z = torch.randn(32, G.module.zdim, device=device)
    ema_beta = 0.5 ** (args.batch * world / (args.ema_kimg * 1000))
    t0 = time.time()

    for it in range(start, args.iters):
        real = next(data).to(device, non_blocking=True)
        # D step
        z = torch.randn(args.batch, G.module.zdim, device=device)
        with torch.no_grad():
            fake = G(z)
        d_loss = F.softplus(D(fake)).mean() + F.softplus(-D(real)).mean()
        d_opt.zero_grad(set_to_none=True)
        d_loss.backward()
        d_opt.step()

        # G step
        z = torch.randn(args.batch, G.module.zdim, device=device)
        g_loss = F.softplus(-D(G(z))).mean()
        g_opt.zero_grad(set_to_none=True)
        g_loss.backward()
        g_opt.step()

        with torch.no_grad():
            for pe, p in zip(G_ema.parameters(), G.module.parameters()):
                pe.copy_(p.lerp(pe, ema_beta))
            for be, b in zip(G_ema.buffers(), G.module.buffers()):
                be.copy_(b)

        if it % 100 == 0:
            losses = torch.stack([d_loss.detach(), g_loss.detach()])
            dist.all_reduce(losses)
            losses /= world
            if rank == 0:
                print(f"[{it:07d}] d {losses[0]:.3f} g {losses[1]:.3f} ({(time.time() - t0) / 100:.3f}s/it)", flush=True)
                t0 = time.time()

        if it % 5000 == 0:
            if rank == 0:
                with torch.no_grad():
                    s = G_ema(sample_z)
                save_image(s, os.path.join(args.out, "samples", f"{it:07d}.png"), nrow=8, normalize=True,
                           value_range=(-1, 1))
                torch.save({"g": G.module.state_dict(), "d": D.module.state_dict(), "g_ema": G_ema.state_dict(),
                            "g_opt": g_opt.state_dict(), "d_opt": d_opt.state_dict(), "iter": it + 1},
                           os.path.join(args.out, f"{it:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
