"""StyleGAN2 (256px) with fp16 autocast for the main G/D losses and fp32 lazy regularisation.

    torchrun --nproc_per_node=8 train_fp16.py --data /data/ffhq256 --out runs/sg2_fp16
"""
import argparse
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import autograd
from torch.cuda.amp import GradScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms, utils

from model import Discriminator, Generator

log = logging.getLogger("train")
Z = 512


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/sg2_fp16")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=400_000)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--r1", type=float, default=10.0)
    p.add_argument("--d_reg_every", type=int, default=16)
    p.add_argument("--g_reg_every", type=int, default=4)
    p.add_argument("--pl_weight", type=float, default=2.0)
    p.add_argument("--mixing", type=float, default=0.9)
    p.add_argument("--save_every", type=int, default=10_000)
    p.add_argument("--resume", default=None)
    return p.parse_args()


def noise(n, prob, device):
    if random.random() < prob:
        return list(torch.randn(2, n, Z, device=device).unbind(0))
    return [torch.randn(n, Z, device=device)]


def loop(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for x, _ in loader:
            yield x
        ep += 1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")

    torch.manual_seed(0)
    G = Generator(args.size, Z, 8, channel_multiplier=2).to(device)
    D = Discriminator(args.size, channel_multiplier=2).to(device)
    G_ema = Generator(args.size, Z, 8, channel_multiplier=2).to(device).eval()
    G_ema.load_state_dict(G.state_dict())
    G_ema.requires_grad_(False)

    gr = args.g_reg_every / (args.g_reg_every + 1)
    dr = args.d_reg_every / (args.d_reg_every + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr * gr, betas=(0, 0.99 ** gr))
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * dr, betas=(0, 0.99 ** dr))
    scaler_G, scaler_D = GradScaler(), GradScaler()

    step = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ck["G"])
        D.load_state_dict(ck["D"])
        G_ema.load_state_dict(ck["G_ema"])
        opt_G.load_state_dict(ck["opt_G"])
        opt_D.load_state_dict(ck["opt_D"])
        scaler_G.load_state_dict(ck["scaler_G"])
        scaler_D.load_state_dict(ck["scaler_D"])
        step = ck["step"]

    G = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D = DDP(D, device_ids=[local_rank], broadcast_buffers=False)
    random.seed(rank + step)
    torch.manual_seed(rank + step)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    data = loop(DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=6, pin_memory=True,
                           drop_last=True, persistent_workers=True), sampler)

    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    accum = 0.5 ** (32 / (10 * 1000))
    mean_path_length = torch.zeros((), device=device)
    sample_z = torch.randn(16, Z, device=device)

    while step < args.steps:
        real = next(data).to(device, non_blocking=True)

        # ---------------- D (fp16) ----------------
        G.requires_grad_(False)
        D.requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.float16):
            fake, _ = G(noise(args.batch, args.mixing, device))
            d_loss = F.softplus(D(fake)).mean() + F.softplus(-D(real)).mean()
        if not torch.isfinite(d_loss):
            log.warning("non-finite D loss at step %d, skipping batch", step)
            step += 1
            continue
        opt_D.zero_grad(set_to_none=True)
        scaler_D.scale(d_loss).backward()
        scaler_D.step(opt_D)
        scaler_D.update()

        # R1 in fp32
        if step % args.d_reg_every == 0:
            real.requires_grad_(True)
            pred = D(real)
            (g,) = autograd.grad(pred.sum(), real, create_graph=True)
            r1 = g.pow(2).flatten(1).sum(1).mean()
            opt_D.zero_grad(set_to_none=True)
            (args.r1 / 2 * r1 * args.d_reg_every + 0 * pred[0]).backward()
            opt_D.step()

        # ---------------- G (fp16) ----------------
        G.requires_grad_(True)
        D.requires_grad_(False)
        with torch.autocast("cuda", dtype=torch.float16):
            fake, _ = G(noise(args.batch, args.mixing, device))
            g_loss = F.softplus(-D(fake)).mean()
        opt_G.zero_grad(set_to_none=True)
        scaler_G.scale(g_loss).backward()
        scaler_G.step(opt_G)
        scaler_G.update()

        # path length in fp32
        if step % args.g_reg_every == 0:
            img, lat = G(noise(args.batch // 2, args.mixing, device), return_latents=True)
            y = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
            (jg,) = autograd.grad((img * y).sum(), lat, create_graph=True)
            lengths = jg.pow(2).sum(2).mean(1).sqrt()
            pm = mean_path_length + 0.01 * (lengths.mean() - mean_path_length)
            pl = (lengths - pm).pow(2).mean()
            mean_path_length = pm.detach()
            opt_G.zero_grad(set_to_none=True)
            (args.pl_weight * args.g_reg_every * pl + 0 * img[0, 0, 0, 0]).backward()
            opt_G.step()

        with torch.no_grad():
            for pe, p in zip(G_ema.parameters(), G.module.parameters()):
                pe.mul_(accum).add_(p, alpha=1 - accum)

        if step % 100 == 0:
            t = torch.stack([d_loss.detach().float(), g_loss.detach().float(), mean_path_length])
            dist.all_reduce(t)
            t /= world
            if rank == 0:
                writer.add_scalar("loss/D", t[0].item(), step)
                writer.add_scalar("loss/G", t[1].item(), step)
                writer.add_scalar("pl/mean", t[2].item(), step)
                writer.add_scalar("amp/scale_D", scaler_D.get_scale(), step)

        if step % args.save_every == 0 and rank == 0:
            with torch.no_grad():
                s, _ = G_ema([sample_z])
            utils.save_image(s, os.path.join(args.out, f"sample_{step:07d}.png"), nrow=4, normalize=True,
                             value_range=(-1, 1))
            torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                        "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(),
                        "scaler_G": scaler_G.state_dict(), "scaler_D": scaler_D.state_dict(), "step": step},
                       os.path.join(args.out, f"ckpt_{step:07d}.pt"))
        step += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
