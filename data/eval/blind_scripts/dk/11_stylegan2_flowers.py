"""StyleGAN2 + ADA on Oxford-102 Flowers (256px), logged to Weights & Biases.

torchrun --standalone --nproc_per_node=4 train_flowers.py --data_dir /data/flowers102/jpg --run_name sg2-flowers
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.image.kid import KernelInceptionDistance
from torchvision import datasets, transforms
from torchvision.utils import make_grid

from models import StyleGAN2Discriminator, StyleGAN2Generator
from ops.ada import AdaptiveAugmenter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--run_name", default="sg2-flowers")
    p.add_argument("--ckpt_dir", default="checkpoints")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--batch_per_gpu", type=int, default=16)
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--lr", type=float, default=0.0025)
    p.add_argument("--r1_gamma", type=float, default=1.0)
    p.add_argument("--r1_interval", type=int, default=16)
    p.add_argument("--pl_interval", type=int, default=4)
    p.add_argument("--pl_weight", type=float, default=2.0)
    p.add_argument("--style_mix", type=float, default=0.9)
    p.add_argument("--ema_kimg", type=float, default=10.0)
    p.add_argument("--ada_target", type=float, default=0.6)
    p.add_argument("--ada_interval", type=int, default=4)
    p.add_argument("--kid_every", type=int, default=10_000)
    p.add_argument("--kid_samples", type=int, default=8000)
    p.add_argument("--seed", type=int, default=123)
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def endless(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, _ in loader:
            yield x
        epoch += 1


@torch.no_grad()
def run_kid(kid, G_ema, loader, n_per_rank, z_dim, device):
    kid.reset()
    seen = 0
    for x, _ in loader:
        if seen >= n_per_rank:
            break
        x = x[: n_per_rank - seen].to(device)
        kid.update(((x + 1) * 127.5).clamp(0, 255).to(torch.uint8), real=True)
        z = torch.randn(x.size(0), z_dim, device=device)
        fake = G_ema(z, truncation=1.0)[0]
        kid.update(((fake + 1) * 127.5).clamp(0, 255).to(torch.uint8), real=False)
        seen += x.size(0)
    mean, std = kid.compute()
    return mean.item(), std.item()


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)

    wandb.init(project="stylegan2-flowers", name=args.run_name, config=vars(args))

    tf = transforms.Compose([
        transforms.Resize(args.resolution),
        transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    ])
    dataset = datasets.ImageFolder(os.path.dirname(args.data_dir.rstrip("/")), transform=tf)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    data = endless(loader, sampler)
    eval_sampler = DistributedSampler(dataset, shuffle=False)
    eval_loader = DataLoader(dataset, batch_size=64, sampler=eval_sampler, num_workers=4)

    torch.manual_seed(args.seed)
    G = StyleGAN2Generator(z_dim=512, w_dim=512, resolution=args.resolution).to(device)
    D = StyleGAN2Discriminator(resolution=args.resolution).to(device)
    G_ema = copy.deepcopy(G).eval().requires_grad_(False)
    torch.manual_seed(args.seed + rank)

    g_ratio = args.pl_interval / (args.pl_interval + 1)
    d_ratio = args.r1_interval / (args.r1_interval + 1)
    opt_G = torch.optim.Adam(G.parameters(), lr=args.lr * g_ratio, betas=(0.0, 0.99 ** g_ratio))
    opt_D = torch.optim.Adam(D.parameters(), lr=args.lr * d_ratio, betas=(0.0, 0.99 ** d_ratio))
    G = DDP(G, device_ids=[local_rank], broadcast_buffers=False)
    D = DDP(D, device_ids=[local_rank], broadcast_buffers=False)

    ada = AdaptiveAugmenter(target=args.ada_target, interval=args.ada_interval,
                            batch_total=args.batch_per_gpu * world_size, device=device)
    kid = KernelInceptionDistance(subset_size=1000, normalize=False).to(device)
    fixed_z = torch.randn(36, 512, device=device)
    ema_beta = 0.5 ** (args.batch_per_gpu * world_size / (args.ema_kimg * 1000))
    pl_mean = torch.zeros((), device=device)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    t_last = time.time()
    for step in range(args.steps):
        real = next(data).to(device, non_blocking=True)

        # discriminator (R1 folded into the same pass on regularisation steps)
        G.requires_grad_(False)
        D.requires_grad_(True)
        do_r1 = step % args.r1_interval == 0
        with torch.no_grad():
            fake, _ = G(torch.randn(args.batch_per_gpu, 512, device=device), mix_prob=args.style_mix)
        real.requires_grad_(do_r1)
        logits_real = D(ada.augment(real))
        logits_fake = D(ada.augment(fake))
        loss_d = F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()
        loss_r1 = torch.zeros((), device=device)
        if do_r1:
            (grad,) = torch.autograd.grad(logits_real.sum(), real, create_graph=True)
            loss_r1 = grad.square().sum(dim=[1, 2, 3]).mean() * (args.r1_gamma / 2) * args.r1_interval
        opt_D.zero_grad(set_to_none=True)
        (loss_d + loss_r1).backward()
        opt_D.step()
        ada.accumulate(logits_real.detach())
        ada.update(step)  # all-reduces its sign statistics every `interval` steps

        # generator
        G.requires_grad_(True)
        D.requires_grad_(False)
        fake, _ = G(torch.randn(args.batch_per_gpu, 512, device=device), mix_prob=args.style_mix)
        loss_g = F.softplus(-D(ada.augment(fake))).mean()
        opt_G.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_G.step()

        loss_pl = torch.zeros((), device=device)
        if step % args.pl_interval == 0:
            n = max(1, args.batch_per_gpu // 2)
            img, ws = G(torch.randn(n, 512, device=device), mix_prob=args.style_mix)
            y = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
            (jg,) = torch.autograd.grad((img * y).sum(), ws, create_graph=True)
            lengths = jg.square().sum(2).mean(1).sqrt()
            new_mean = pl_mean.lerp(lengths.mean(), 0.01)
            pl_mean.copy_(new_mean.detach())
            loss_pl = (lengths - new_mean).square().mean() * args.pl_weight * args.pl_interval
            opt_G.zero_grad(set_to_none=True)
            (loss_pl + 0 * img[0, 0, 0, 0]).backward()
            opt_G.step()

        with torch.no_grad():
            for pe, p in zip(G_ema.parameters(), G.module.parameters()):
                pe.lerp_(p, 1 - ema_beta)
            for be, b in zip(G_ema.buffers(), G.module.buffers()):
                be.copy_(b)

        if step % 50 == 0:
            logs = torch.stack([loss_d.detach(), loss_g.detach(), loss_r1.detach(), loss_pl.detach()])
            dist.all_reduce(logs, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t_last) / 50
                t_last = time.time()
                wandb.log({"loss/D": logs[0].item(), "loss/G": logs[1].item(), "loss/R1": logs[2].item(),
                           "loss/PL": logs[3].item(), "ada/p": ada.p, "ada/rt": ada.rt, "sec_per_step": dt},
                          step=step)

        if step % args.kid_every == 0 and step > 0:
            kid_mean, kid_std = run_kid(kid, G_ema, eval_loader, args.kid_samples // world_size, 512, device)
            if rank == 0:
                with torch.no_grad():
                    grid = make_grid(G_ema(fixed_z)[0], nrow=6, normalize=True, value_range=(-1, 1))
                wandb.log({"metrics/kid": kid_mean, "metrics/kid_std": kid_std,
                           "samples": wandb.Image(grid)}, step=step)
                torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(), "G_ema": G_ema.state_dict(),
                            "opt_G": opt_G.state_dict(), "opt_D": opt_D.state_dict(), "ada_p": ada.p,
                            "step": step}, os.path.join(args.ckpt_dir, f"{args.run_name}_{step:07d}.pt"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
