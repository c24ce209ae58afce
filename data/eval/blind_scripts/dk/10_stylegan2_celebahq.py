import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from scipy import linalg
from torch import autograd, optim
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils import data
from torchvision import transforms, utils
from tqdm import tqdm

from calc_inception import load_patched_inception_v3
from dataset import MultiResolutionDataset
from model import Discriminator, Generator


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def synchronize():
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def reduce_loss_dict(loss_dict):
    world_size = dist.get_world_size()
    with torch.no_grad():
        keys = sorted(loss_dict.keys())
        losses = torch.stack([loss_dict[k] for k in keys], 0)
        dist.reduce(losses, dst=0)
        if dist.get_rank() == 0:
            losses /= world_size
        return {k: v for k, v in zip(keys, losses)}


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


def mixing_noise(batch, latent_dim, prob, device):
    if prob > 0 and random.random() < prob:
        return torch.randn(2, batch, latent_dim, device=device).unbind(0)
    return [torch.randn(batch, latent_dim, device=device)]


def d_r1_loss(real_pred, real_img):
    (grad_real,) = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


def g_path_regularize(fake_img, latents, mean_path_length, decay=0.01):
    noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[2] * fake_img.shape[3])
    (grad,) = autograd.grad(outputs=(fake_img * noise).sum(), inputs=latents, create_graph=True)
    path_lengths = torch.sqrt(grad.pow(2).sum(2).mean(1))
    path_mean = mean_path_length + decay * (path_lengths.mean() - mean_path_length)
    return (path_lengths - path_mean).pow(2).mean(), path_mean.detach(), path_lengths


@torch.no_grad()
def fid_score(g_ema, inception, real_mean, real_cov, n_sample, batch, latent, device):
    world_size = dist.get_world_size()
    n_local = n_sample // world_size
    feats = []
    for s in range(0, n_local, batch):
        b = min(batch, n_local - s)
        img, _ = g_ema([torch.randn(b, latent, device=device)])
        feats.append(inception(img)[0].view(b, -1).cpu().numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, np.concatenate(feats))
    if get_rank() != 0:
        return None
    x = np.concatenate(parts)
    mean, cov = x.mean(0), np.cov(x, rowvar=False)
    cov_sqrt, _ = linalg.sqrtm(cov @ real_cov, disp=False)
    return float(((mean - real_mean) ** 2).sum() + np.trace(cov) + np.trace(real_cov) - 2 * np.trace(cov_sqrt.real))


def train(args, loader, sampler, generator, discriminator, g_optim, d_optim, g_ema, inception, device):
    loader = sample_data(loader, sampler)
    pbar = range(args.iter)
    if get_rank() == 0:
        pbar = tqdm(pbar, initial=args.start_iter, dynamic_ncols=True, smoothing=0.01)

    stats = np.load(args.inception_stats)
    mean_path_length = 0
    r1_loss = torch.tensor(0.0, device=device)
    path_loss = torch.tensor(0.0, device=device)
    loss_dict = {}
    g_module, d_module = generator.module, discriminator.module
    accum = 0.5 ** (32 / (10 * 1000))
    sample_z = torch.randn(args.n_sample, args.latent, device=device)

    for idx in pbar:
        i = idx + args.start_iter
        if i > args.iter:
            break

        real_img = next(loader).to(device)

        requires_grad(generator, False)
        requires_grad(discriminator, True)
        fake_img, _ = generator(mixing_noise(args.batch, args.latent, args.mixing, device))
        fake_pred = discriminator(fake_img)
        real_pred = discriminator(real_img)
        d_loss = F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()
        loss_dict["d"] = d_loss
        loss_dict["real_score"] = real_pred.mean()
        loss_dict["fake_score"] = fake_pred.mean()
        discriminator.zero_grad()
        d_loss.backward()
        d_optim.step()

        if i % args.d_reg_every == 0:
            real_img.requires_grad = True
            real_pred = discriminator(real_img)
            r1_loss = d_r1_loss(real_pred, real_img)
            discriminator.zero_grad()
            (args.r1 / 2 * r1_loss * args.d_reg_every + 0 * real_pred[0]).backward()
            d_optim.step()
        loss_dict["r1"] = r1_loss

        requires_grad(generator, True)
        requires_grad(discriminator, False)
        fake_img, _ = generator(mixing_noise(args.batch, args.latent, args.mixing, device))
        g_loss = F.softplus(-discriminator(fake_img)).mean()
        loss_dict["g"] = g_loss
        generator.zero_grad()
        g_loss.backward()
        g_optim.step()

        if i % args.g_reg_every == 0:
            path_batch_size = max(1, args.batch // args.path_batch_shrink)
            fake_img, latents = generator(mixing_noise(path_batch_size, args.latent, args.mixing, device),
                                          return_latents=True)
            path_loss, mean_path_length, _ = g_path_regularize(fake_img, latents, mean_path_length)
            generator.zero_grad()
            weighted_path_loss = args.path_regularize * args.g_reg_every * path_loss
            if args.path_batch_shrink:
                weighted_path_loss += 0 * fake_img[0, 0, 0, 0]
            weighted_path_loss.backward()
            g_optim.step()
        loss_dict["path"] = path_loss

        accumulate(g_ema, g_module, accum)
        loss_reduced = reduce_loss_dict(loss_dict)

        if get_rank() == 0:
            pbar.set_description(
                f"d: {loss_reduced['d'].item():.4f}; g: {loss_reduced['g'].item():.4f}; "
                f"r1: {loss_reduced['r1'].item():.4f}; path: {loss_reduced['path'].item():.4f}"
            )
            if i % 1000 == 0:
                with torch.no_grad():
                    g_ema.eval()
                    sample, _ = g_ema([sample_z])
                    utils.save_image(sample, f"sample/{str(i).zfill(6)}.png", nrow=int(args.n_sample ** 0.5),
                                     normalize=True, value_range=(-1, 1))

        if i % args.fid_every == 0 and i > 0:
            fid = fid_score(g_ema, inception, stats["mean"], stats["cov"], args.fid_n, 50, args.latent, device)
            if get_rank() == 0:
                print(f"\n[{i}] fid50k: {fid:.3f}", flush=True)

        if get_rank() == 0 and i % 10000 == 0:
            torch.save(
                {"g": g_module.state_dict(), "d": d_module.state_dict(), "g_ema": g_ema.state_dict(),
                 "g_optim": g_optim.state_dict(), "d_optim": d_optim.state_dict(), "args": args},
                f"checkpoint/{str(i).zfill(6)}.pt",
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="StyleGAN2 trainer (CelebA-HQ)")
    parser.add_argument("path", type=str)
    parser.add_argument("--iter", type=int, default=800000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--n_sample", type=int, default=64)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--r1", type=float, default=10)
    parser.add_argument("--path_regularize", type=float, default=2)
    parser.add_argument("--path_batch_shrink", type=int, default=2)
    parser.add_argument("--d_reg_every", type=int, default=16)
    parser.add_argument("--g_reg_every", type=int, default=4)
    parser.add_argument("--mixing", type=float, default=0.9)
    parser.add_argument("--ckpt", type=str, default=None)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--channel_multiplier", type=int, default=2)
    parser.add_argument("--fid_every", type=int, default=50000)
    parser.add_argument("--fid_n", type=int, default=50000)
    parser.add_argument("--inception_stats", type=str, default="inception_celebahq1024.pkl.npz")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    synchronize()
    device = torch.device("cuda", local_rank)

    args.latent = 512
    args.n_mlp = 8
    args.start_iter = 0

    torch.manual_seed(0)
    generator = Generator(args.size, args.latent, args.n_mlp, channel_multiplier=args.channel_multiplier).to(device)
    discriminator = Discriminator(args.size, channel_multiplier=args.channel_multiplier).to(device)
    g_ema = Generator(args.size, args.latent, args.n_mlp, channel_multiplier=args.channel_multiplier).to(device)
    g_ema.eval()
    accumulate(g_ema, generator, 0)
    random.seed(get_rank())
    torch.manual_seed(get_rank())

    g_reg_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_reg_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_optim = optim.Adam(generator.parameters(), lr=args.lr * g_reg_ratio, betas=(0 ** g_reg_ratio, 0.99 ** g_reg_ratio))
    d_optim = optim.Adam(discriminator.parameters(), lr=args.lr * d_reg_ratio, betas=(0 ** d_reg_ratio, 0.99 ** d_reg_ratio))

    if args.ckpt is not None:
        ckpt = torch.load(args.ckpt, map_location=lambda storage, loc: storage)
        try:
            args.start_iter = int(os.path.splitext(os.path.basename(args.ckpt))[0])
        except ValueError:
            pass
        generator.load_state_dict(ckpt["g"])
        discriminator.load_state_dict(ckpt["d"])
        g_ema.load_state_dict(ckpt["g_ema"])
        g_optim.load_state_dict(ckpt["g_optim"])
        d_optim.load_state_dict(ckpt["d_optim"])

    generator = DistributedDataParallel(generator, device_ids=[local_rank], output_device=local_rank,
                                        broadcast_buffers=False)
    discriminator = DistributedDataParallel(discriminator, device_ids=[local_rank], output_device=local_rank,
                                            broadcast_buffers=False)

    inception = load_patched_inception_v3().to(device).eval()

    transform = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), inplace=True),
    ])
    dataset = MultiResolutionDataset(args.path, transform, args.size)
    sampler = data.distributed.DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=4, drop_last=True)

    if get_rank() == 0:
        os.makedirs("sample", exist_ok=True)
        os.makedirs("checkpoint", exist_ok=True)
    synchronize()

    train(args, loader, sampler, generator, discriminator, g_optim, d_optim, g_ema, inception, device)
    dist.destroy_process_group()
