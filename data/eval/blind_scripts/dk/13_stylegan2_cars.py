"""StyleGAN2 on Stanford Cars (512x384 padded to 512x512) with automatic resume.

The job is preemptible, so it restarts from the newest checkpoint in --out when relaunched:

    torchrun --nproc_per_node=8 train_cars.py --data /data/cars_lmdb --out /shared/exp/sg2_cars
"""
import argparse
import glob
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import autograd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms, utils

from dataset import MultiResolutionDataset
from model import Discriminator, Generator

LATENT = 512


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=500_000)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--r1", type=float, default=10.0)
    p.add_argument("--d_reg_every", type=int, default=16)
    p.add_argument("--g_reg_every", type=int, default=4)
    p.add_argument("--pl_weight", type=float, default=2.0)
    p.add_argument("--mixing", type=float, default=0.9)
    p.add_argument("--ckpt_every", type=int, default=5000)
    p.add_argument("--keep", type=int, default=3)
    return p.parse_args()


def mixing_noise(n, prob, device):
    if random.random() < prob:
        return list(torch.randn(2, n, LATENT, device=device).unbind(0))
    return [torch.randn(n, LATENT, device=device)]


def find_latest(out_dir):
    ckpts = sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")))
    return ckpts[-1] if ckpts else None


def save_checkpoint(path, it, g, d, g_ema, g_opt, d_opt, mean_path_length):
    tmp = path + ".tmp"
    torch.save({"iter": it, "g": g.state_dict(), "d": d.state_dict(), "g_ema": g_ema.state_dict(),
                "g_optim": g_opt.state_dict(), "d_optim": d_opt.state_dict(),
                "mean_path_length": mean_path_length}, tmp)
    os.replace(tmp, path)


def prune(out_dir, keep):
    for old in sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt")))[:-keep]:
        os.remove(old)


@torch.no_grad()
def ema(g_ema, g, decay):
    for pe, p in zip(g_ema.parameters(), g.parameters()):
        pe.mul_(decay).add_(p, alpha=1 - decay)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(0)
    g = Generator(args.size, LATENT, 8, channel_multiplier=2).to(device)
    d = Discriminator(args.size, channel_multiplier=2).to(device)
    g_ema = Generator(args.size, LATENT, 8, channel_multiplier=2).to(device).eval()
    ema(g_ema, g, 0.0)

    g_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_opt = torch.optim.Adam(g.parameters(), lr=args.lr * g_ratio, betas=(0, 0.99 ** g_ratio))
    d_opt = torch.optim.Adam(d.parameters(), lr=args.lr * d_ratio, betas=(0, 0.99 ** d_ratio))

    start_iter, mean_path_length = 0, 0.0
    latest = find_latest(args.out)
    if latest is not None:
        state = torch.load(latest)
        g.load_state_dict(state["g"])
        d.load_state_dict(state["d"])
        g_ema.load_state_dict(state["g_ema"])
        g_opt.load_state_dict(state["g_optim"])
        d_opt.load_state_dict(state["d_optim"])
        start_iter = state["iter"] + 1
        mean_path_length = state["mean_path_length"]
        del state
        if rank == 0:
            print(f"resumed from {latest} at iter {start_iter}", flush=True)

    random.seed(start_iter * world + rank)
    torch.manual_seed(start_iter * world + rank)

    g_ddp = DDP(g, device_ids=[local_rank], broadcast_buffers=False)
    d_ddp = DDP(d, device_ids=[local_rank], broadcast_buffers=False)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    dataset = MultiResolutionDataset(args.data, tf, args.size)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    steps_per_epoch = len(loader)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    sample_z = torch.randn(16, LATENT, device=device)
    accum = 0.5 ** (32 / (10 * 1000))

    it = start_iter
    epoch = start_iter // steps_per_epoch
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for real in loader:
            if it >= args.iters:
                break
            real = real.to(device, non_blocking=True)

            g_ddp.requires_grad_(False)
            d_ddp.requires_grad_(True)
            fake, _ = g_ddp(mixing_noise(args.batch, args.mixing, device))
            d_loss = F.softplus(d_ddp(fake)).mean() + F.softplus(-d_ddp(real)).mean()
            d_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            d_opt.step()

            if it % args.d_reg_every == 0:
                real.requires_grad_(True)
                pred = d_ddp(real)
                (grad,) = autograd.grad(pred.sum(), real, create_graph=True)
                r1 = grad.pow(2).flatten(1).sum(1).mean()
                d_opt.zero_grad(set_to_none=True)
                (args.r1 / 2 * r1 * args.d_reg_every + 0 * pred[0]).backward()
                d_opt.step()

            g_ddp.requires_grad_(True)
            d_ddp.requires_grad_(False)
            fake, _ = g_ddp(mixing_noise(args.batch, args.mixing, device))
            g_loss = F.softplus(-d_ddp(fake)).mean()
            g_opt.zero_grad(set_to_none=True)
            g_loss.backward()
            g_opt.step()

            if it % args.g_reg_every == 0:
                img, lat = g_ddp(mixing_noise(max(1, args.batch // 2), args.mixing, device), return_latents=True)
                noise = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
                (grad,) = autograd.grad((img * noise).sum(), lat, create_graph=True)
                lengths = grad.pow(2).sum(2).mean(1).sqrt()
                pm = mean_path_length + 0.01 * (lengths.mean() - mean_path_length)
                pl_loss = (lengths - pm).pow(2).mean()
                mean_path_length = pm.detach()
                g_opt.zero_grad(set_to_none=True)
                (args.pl_weight * args.g_reg_every * pl_loss + 0 * img[0, 0, 0, 0]).backward()
                g_opt.step()

            ema(g_ema, g, accum)

            if it % 100 == 0:
                vals = torch.stack([d_loss.detach(), g_loss.detach()])
                dist.all_reduce(vals)
                vals /= world
                if rank == 0:
                    writer.add_scalar("loss/d", vals[0].item(), it)
                    writer.add_scalar("loss/g", vals[1].item(), it)
                    writer.add_scalar("perf/sec_per_it", (time.time() - t0) / 100, it)
                    t0 = time.time()

            if it % args.ckpt_every == 0 and it > start_iter and rank == 0:
                with torch.no_grad():
                    s, _ = g_ema([sample_z])
                utils.save_image(s, os.path.join(args.out, "samples", f"{it:07d}.png"), nrow=4,
                                 normalize=True, value_range=(-1, 1))
                save_checkpoint(os.path.join(args.out, f"ckpt_{it:07d}.pt"), it, g, d, g_ema, g_opt, d_opt,
                                float(mean_path_length))
                prune(args.out, args.keep)
            it += 1
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
