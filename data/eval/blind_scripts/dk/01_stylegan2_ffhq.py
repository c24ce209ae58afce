"""StyleGAN2 training on FFHQ (LMDB), multi-GPU with torchrun.

Usage:
    torchrun --nproc_per_node=8 train.py --path /data/ffhq_lmdb --size 256 --batch 8
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import autograd, optim
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import data
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms, utils
from tqdm import tqdm

from dataset import MultiResolutionDataset
from model import Generator, Discriminator


def requires_grad(model, flag=True):
    for p in model.parameters():
        p.requires_grad = flag


def accumulate(model1, model2, decay=0.999):
    par1 = dict(model1.named_parameters())
    par2 = dict(model2.named_parameters())
    for k in par1.keys():
        par1[k].data.mul_(decay).add_(par2[k].data, alpha=1 - decay)


def sample_data(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def reduce_loss_dict(loss_dict, world_size):
    with torch.no_grad():
        keys = sorted(loss_dict.keys())
        losses = torch.stack([loss_dict[k].detach() for k in keys])
        dist.all_reduce(losses)
        losses /= world_size
    return {k: v.item() for k, v in zip(keys, losses)}


def d_logistic_loss(real_pred, fake_pred):
    return F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()


def d_r1_loss(real_pred, real_img):
    (grad_real,) = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


def g_nonsaturating_loss(fake_pred):
    return F.softplus(-fake_pred).mean()


def g_path_regularize(fake_img, latents, mean_path_length, decay=0.01):
    noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[2] * fake_img.shape[3])
    (grad,) = autograd.grad(outputs=(fake_img * noise).sum(), inputs=latents, create_graph=True)
    path_lengths = torch.sqrt(grad.pow(2).sum(2).mean(1))
    path_mean = mean_path_length + decay * (path_lengths.mean() - mean_path_length)
    path_penalty = (path_lengths - path_mean).pow(2).mean()
    return path_penalty, path_mean.detach(), path_lengths


def make_noise(batch, latent_dim, n_noise, device):
    if n_noise == 1:
        return torch.randn(batch, latent_dim, device=device)
    return torch.randn(n_noise, batch, latent_dim, device=device).unbind(0)


def mixing_noise(batch, latent_dim, prob, device):
    if prob > 0 and random.random() < prob:
        return make_noise(batch, latent_dim, 2, device)
    return [make_noise(batch, latent_dim, 1, device)]


def train(args, loader, sampler, generator, discriminator, g_optim, d_optim, g_ema, device, rank, world_size):
    loader = sample_data(loader, sampler)
    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    pbar = tqdm(range(args.iter), initial=args.start_iter, dynamic_ncols=True) if rank == 0 else range(args.iter)

    mean_path_length = 0
    r1_loss = torch.tensor(0.0, device=device)
    path_loss = torch.tensor(0.0, device=device)
    path_lengths = torch.tensor(0.0, device=device)
    loss_dict = {}

    g_module = generator.module
    d_module = discriminator.module
    accum = 0.5 ** (32 / (10 * 1000))
    sample_z = torch.randn(args.n_sample, args.latent, device=device)

    for idx in pbar:
        i = idx + args.start_iter
        if i > args.iter:
            break

        real_img = next(loader).to(device, non_blocking=True)

        # ---------------- discriminator ----------------
        requires_grad(generator, False)
        requires_grad(discriminator, True)

        noise = mixing_noise(args.batch, args.latent, args.mixing, device)
        fake_img, _ = generator(noise)
        fake_pred = discriminator(fake_img)
        real_pred = discriminator(real_img)
        d_loss = d_logistic_loss(real_pred, fake_pred)

        loss_dict["d"] = d_loss
        loss_dict["real_score"] = real_pred.mean()
        loss_dict["fake_score"] = fake_pred.mean()

        discriminator.zero_grad(set_to_none=True)
        d_loss.backward()
        d_optim.step()

        d_regularize = i % args.d_reg_every == 0
        if d_regularize:
            real_img.requires_grad = True
            real_pred = discriminator(real_img)
            r1_loss = d_r1_loss(real_pred, real_img)

            discriminator.zero_grad(set_to_none=True)
            (args.r1 / 2 * r1_loss * args.d_reg_every).backward()
            d_optim.step()

        loss_dict["r1"] = r1_loss

        # ---------------- generator ----------------
        requires_grad(generator, True)
        requires_grad(discriminator, False)

        noise = mixing_noise(args.batch, args.latent, args.mixing, device)
        fake_img, _ = generator(noise)
        fake_pred = discriminator(fake_img)
        g_loss = g_nonsaturating_loss(fake_pred)
        loss_dict["g"] = g_loss

        generator.zero_grad(set_to_none=True)
        g_loss.backward()
        g_optim.step()

        g_regularize = i % args.g_reg_every == 0
        if g_regularize:
            path_batch_size = max(1, args.batch // args.path_batch_shrink)
            noise = mixing_noise(path_batch_size, args.latent, args.mixing, device)
            fake_img, latents = generator(noise, return_latents=True)
            path_loss, mean_path_length, path_lengths = g_path_regularize(fake_img, latents, mean_path_length)

            generator.zero_grad(set_to_none=True)
            weighted_path_loss = args.path_regularize * args.g_reg_every * path_loss
            if args.path_batch_shrink:
                weighted_path_loss += 0 * fake_img[0, 0, 0, 0]
            weighted_path_loss.backward()
            g_optim.step()

        loss_dict["path"] = path_loss
        loss_dict["path_length"] = path_lengths.mean()

        accumulate(g_ema, g_module, accum)

        loss_reduced = reduce_loss_dict(loss_dict, world_size)

        if rank == 0:
            pbar.set_description(
                f"d: {loss_reduced['d']:.4f}; g: {loss_reduced['g']:.4f}; r1: {loss_reduced['r1']:.4f}; "
                f"path: {loss_reduced['path']:.4f}"
            )
            if i % 100 == 0:
                for k, v in loss_reduced.items():
                    writer.add_scalar(f"train/{k}", v, i)

            if i % args.sample_every == 0:
                with torch.no_grad():
                    g_ema.eval()
                    sample, _ = g_ema([sample_z])
                    utils.save_image(
                        sample,
                        os.path.join(args.out_dir, "sample", f"{str(i).zfill(6)}.png"),
                        nrow=int(args.n_sample ** 0.5),
                        normalize=True,
                        value_range=(-1, 1),
                    )

            if i % args.save_every == 0:
                torch.save(
                    {
                        "g": g_module.state_dict(),
                        "d": d_module.state_dict(),
                        "g_ema": g_ema.state_dict(),
                        "g_optim": g_optim.state_dict(),
                        "d_optim": d_optim.state_dict(),
                        "args": vars(args),
                        "iter": i,
                    },
                    os.path.join(args.out_dir, "checkpoint", f"{str(i).zfill(6)}.pt"),
                )

    if writer is not None:
        writer.close()


def main():
    parser = argparse.ArgumentParser(description="StyleGAN2 trainer")
    parser.add_argument("--path", type=str, required=True)
    parser.add_argument("--out_dir", type=str, default="runs/ffhq256")
    parser.add_argument("--log_dir", type=str, default="runs/ffhq256/tb")
    parser.add_argument("--iter", type=int, default=800000)
    parser.add_argument("--batch", type=int, default=8, help="batch size per GPU")
    parser.add_argument("--n_sample", type=int, default=64)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--r1", type=float, default=10)
    parser.add_argument("--path_regularize", type=float, default=2)
    parser.add_argument("--path_batch_shrink", type=int, default=2)
    parser.add_argument("--d_reg_every", type=int, default=16)
    parser.add_argument("--g_reg_every", type=int, default=4)
    parser.add_argument("--mixing", type=float, default=0.9)
    parser.add_argument("--ckpt", type=str, default=None)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--channel_multiplier", type=int, default=2)
    parser.add_argument("--sample_every", type=int, default=1000)
    parser.add_argument("--save_every", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    args.latent = 512
    args.n_mlp = 8
    args.start_iter = 0

    if rank == 0:
        os.makedirs(os.path.join(args.out_dir, "sample"), exist_ok=True)
        os.makedirs(os.path.join(args.out_dir, "checkpoint"), exist_ok=True)

    # same init on every rank, different noise streams afterwards
    torch.manual_seed(args.seed)
    generator = Generator(args.size, args.latent, args.n_mlp, channel_multiplier=args.channel_multiplier).to(device)
    discriminator = Discriminator(args.size, channel_multiplier=args.channel_multiplier).to(device)
    g_ema = Generator(args.size, args.latent, args.n_mlp, channel_multiplier=args.channel_multiplier).to(device)
    g_ema.eval()
    accumulate(g_ema, generator, 0)

    g_reg_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_reg_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_optim = optim.Adam(generator.parameters(), lr=args.lr * g_reg_ratio, betas=(0 ** g_reg_ratio, 0.99 ** g_reg_ratio))
    d_optim = optim.Adam(discriminator.parameters(), lr=args.lr * d_reg_ratio, betas=(0 ** d_reg_ratio, 0.99 ** d_reg_ratio))

    if args.ckpt is not None:
        if rank == 0:
            print("load model:", args.ckpt)
        ckpt = torch.load(args.ckpt, map_location="cpu")
        args.start_iter = ckpt.get("iter", 0)
        generator.load_state_dict(ckpt["g"])
        discriminator.load_state_dict(ckpt["d"])
        g_ema.load_state_dict(ckpt["g_ema"])
        g_optim.load_state_dict(ckpt["g_optim"])
        d_optim.load_state_dict(ckpt["d_optim"])
        del ckpt

    seed = args.seed * world_size + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    generator = DDP(generator, device_ids=[local_rank], output_device=local_rank, broadcast_buffers=False)
    discriminator = DDP(discriminator, device_ids=[local_rank], output_device=local_rank, broadcast_buffers=False)

    transform = transforms.Compose(
        [
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), inplace=True),
        ]
    )
    dataset = MultiResolutionDataset(args.path, transform, args.size)
    sampler = data.distributed.DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = data.DataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )

    train(args, loader, sampler, generator, discriminator, g_optim, d_optim, g_ema, device, rank, world_size)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
