"""ViT-VQGAN (Yu et al. 2022) stage 1: ViT encoder/decoder, factorized l2-normalized codes,
L2 + LPIPS + StyleGAN-discriminator loss, EMA of tokenizer weights for evaluation.

    torchrun --nnodes=1 --nproc_per_node=8 15_vitvqgan_imagenet.py --data /datasets/imagenet --out exp/vitvq_b
"""
import argparse
import copy
import os
import time

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from lab_models.vit import ViTDecoder, ViTEncoder
from lab_models.stylegan_disc import StyleGANDiscriminator


def get_parser():
    p = argparse.ArgumentParser("vit-vqgan")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--img_size", type=int, default=256)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--codes", type=int, default=8192)
    p.add_argument("--code_dim", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--iters", type=int, default=500_000)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--adv_w", type=float, default=0.1)
    p.add_argument("--lpips_w", type=float, default=0.1)
    p.add_argument("--save_every", type=int, default=10_000)
    return p


class FactorizedQuantizer(nn.Module):
    def __init__(self, dim, code_dim, n_codes, beta=0.25):
        super().__init__()
        self.down = nn.Linear(dim, code_dim)
        self.up = nn.Linear(code_dim, dim)
        self.codebook = nn.Parameter(torch.randn(n_codes, code_dim))
        self.beta = beta

    def forward(self, h):
        z = F.normalize(self.down(h), dim=-1)
        cb = F.normalize(self.codebook, dim=-1)
        idx = torch.einsum("bnd,kd->bnk", z, cb).argmax(-1)
        zq = cb[idx]
        loss = F.mse_loss(zq, z.detach()) + self.beta * F.mse_loss(z, zq.detach())
        zq = z + (zq - z).detach()
        return self.up(zq), loss, idx


class ViTVQ(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.enc = ViTEncoder(image_size=a.img_size, patch_size=a.patch, dim=a.dim, depth=a.depth, heads=12)
        self.q = FactorizedQuantizer(a.dim, a.code_dim, a.codes)
        self.dec = ViTDecoder(image_size=a.img_size, patch_size=a.patch, dim=a.dim, depth=a.depth, heads=12)

    def forward(self, x):
        h, qloss, idx = self.q(self.enc(x))
        return self.dec(h), qloss, idx


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for pe, p in zip(ema_model.parameters(), model.parameters()):
        pe.lerp_(p, 1 - decay)


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.8, 1.0), ratio=(1.0, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    ds = datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=10, pin_memory=True, drop_last=True)

    gen = ViTVQ(args).to(device)
    ema = copy.deepcopy(gen).eval().requires_grad_(False)
    disc = StyleGANDiscriminator(resolution=args.img_size, channel_multiplier=1).to(device)
    gen = DDP(gen, device_ids=[args.local_rank], output_device=args.local_rank)
    disc = DDP(disc, device_ids=[args.local_rank], output_device=args.local_rank)
    lp = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)

    opt_g = torch.optim.AdamW(gen.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=1e-4)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=1e-4)
    warm = lambda it: min(1.0, (it + 1) / args.warmup)
    sch_g = torch.optim.lr_scheduler.LambdaLR(opt_g, warm)
    sch_d = torch.optim.lr_scheduler.LambdaLR(opt_d, warm)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    it, epoch = 0, 0
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x, _ in dl:
            x = x.to(device, non_blocking=True)
            xr, qloss, idx = gen(x)
            l2 = F.mse_loss(xr, x)
            perc = lp(xr, x).mean()
            g_adv = F.softplus(-disc(xr)).mean()
            loss_g = l2 + args.lpips_w * perc + qloss + args.adv_w * g_adv
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            sch_g.step()
            ema_update(ema, gen.module, args.ema)

            d_in = torch.cat([x, xr.detach()])
            real_logit, fake_logit = disc(d_in).chunk(2)
            loss_d = F.softplus(-real_logit).mean() + F.softplus(fake_logit).mean()
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
            sch_d.step()
            it += 1

            if it % 100 == 0:
                s = torch.stack([l2.detach(), perc.detach(), qloss.detach(), g_adv.detach(), loss_d.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"it {it} l2 {s[0]:.4f} lpips {s[1]:.4f} q {s[2]:.4f} g {s[3]:.3f} d {s[4]:.3f} "
                          f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                    t0 = time.time()
            if it % args.save_every == 0 and rank == 0:
                torch.save({"gen": gen.module.state_dict(), "ema": ema.state_dict(), "disc": disc.module.state_dict(),
                            "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "it": it},
                           os.path.join(args.out, f"vitvq_{it:07d}.pt"))
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
