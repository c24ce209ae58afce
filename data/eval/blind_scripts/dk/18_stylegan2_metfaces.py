"""Fine-tune an FFHQ-1024 StyleGAN2 on MetFaces (1336 images) with ADA.

    torchrun --nproc_per_node=8 finetune_metfaces.py /data/metfaces_lmdb --ckpt pretrained/ffhq-1024.pt --augment
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
from torch import autograd, optim
from torch.nn import functional as F
from torch.utils import data
from torchvision import transforms, utils
from tqdm import tqdm

from dataset import MultiResolutionDataset
from model import Discriminator, Generator
from non_leaking import augment


def requires_grad(model, flag=True):
    for p in model.parameters():
        p.requires_grad = flag


def accumulate(model1, model2, decay=0.999):
    par1 = dict(model1.named_parameters())
    par2 = dict(model2.named_parameters())
    for k in par1.keys():
        par1[k].data.mul_(decay).add_(par2[k].data, alpha=1 - decay)


def sample_data(loader):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def mixing_noise(batch, latent_dim, prob, device):
    if prob > 0 and random.random() < prob:
        return torch.randn(2, batch, latent_dim, device=device).unbind(0)
    return [torch.randn(batch, latent_dim, device=device)]


class AdaptiveAugment:
    def __init__(self, ada_aug_target, ada_aug_len, update_every, device):
        self.ada_aug_target = ada_aug_target
        self.ada_aug_len = ada_aug_len
        self.update_every = update_every
        self.ada_update = 0
        self.ada_aug_buf = torch.tensor([0.0, 0.0], device=device)
        self.r_t_stat = 0
        self.ada_aug_p = 0

    @torch.no_grad()
    def tune(self, real_pred):
        self.ada_aug_buf += torch.tensor(
            (torch.sign(real_pred).sum().item(), real_pred.shape[0]), device=real_pred.device
        )
        self.ada_update += 1
        if self.ada_update % self.update_every == 0:
            dist.all_reduce(self.ada_aug_buf)
            pred_signs, n_pred = self.ada_aug_buf.tolist()
            self.r_t_stat = pred_signs / n_pred
            sign = 1 if self.r_t_stat > self.ada_aug_target else -1
            self.ada_aug_p += sign * n_pred / self.ada_aug_len
            self.ada_aug_p = min(1, max(0, self.ada_aug_p))
            self.ada_aug_buf.mul_(0)
            self.ada_update = 0
        return self.ada_aug_p


def train(args, loader, generator, discriminator, g_optim, d_optim, g_ema, device):
    loader = sample_data(loader)
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    pbar = tqdm(range(args.start_iter, args.iter), dynamic_ncols=True, disable=rank != 0)

    g_module, d_module = generator.module, discriminator.module
    accum = 0.5 ** (32 / (10 * 1000))
    ada_aug_p = args.augment_p if args.augment_p > 0 else 0.0
    ada = AdaptiveAugment(args.ada_target, args.ada_length, 8, device) if args.augment and args.augment_p == 0 else None
    mean_path_length = 0
    sample_z = torch.randn(args.n_sample, args.latent, device=device)

    for i in pbar:
        real_img = next(loader).to(device)

        requires_grad(generator, False)
        requires_grad(discriminator, True)
        fake_img, _ = generator(mixing_noise(args.batch, args.latent, args.mixing, device))
        if args.augment:
            real_img_aug, _ = augment(real_img, ada_aug_p)
            fake_img, _ = augment(fake_img, ada_aug_p)
        else:
            real_img_aug = real_img
        fake_pred = discriminator(fake_img)
        real_pred = discriminator(real_img_aug)
        d_loss = F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()
        discriminator.zero_grad()
        d_loss.backward()
        d_optim.step()
        if ada is not None:
            ada_aug_p = ada.tune(real_pred)

        if i % args.d_reg_every == 0:
            real_img.requires_grad = True
            real_img_aug = augment(real_img, ada_aug_p)[0] if args.augment else real_img
            real_pred = discriminator(real_img_aug)
            (grad_real,) = autograd.grad(real_pred.sum(), real_img, create_graph=True)
            r1_loss = grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()
            discriminator.zero_grad()
            (args.r1 / 2 * r1_loss * args.d_reg_every + 0 * real_pred[0]).backward()
            d_optim.step()

        requires_grad(generator, True)
        requires_grad(discriminator, False)
        fake_img, _ = generator(mixing_noise(args.batch, args.latent, args.mixing, device))
        if args.augment:
            fake_img, _ = augment(fake_img, ada_aug_p)
        g_loss = F.softplus(-discriminator(fake_img)).mean()
        generator.zero_grad()
        g_loss.backward()
        g_optim.step()

        if i % args.g_reg_every == 0:
            pbs = max(1, args.batch // args.path_batch_shrink)
            fake_img, latents = generator(mixing_noise(pbs, args.latent, args.mixing, device), return_latents=True)
            noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[2] * fake_img.shape[3])
            (grad,) = autograd.grad((fake_img * noise).sum(), latents, create_graph=True)
            path_lengths = torch.sqrt(grad.pow(2).sum(2).mean(1))
            path_mean = mean_path_length + 0.01 * (path_lengths.mean() - mean_path_length)
            path_loss = (path_lengths - path_mean).pow(2).mean()
            mean_path_length = path_mean.detach()
            generator.zero_grad()
            (args.path_regularize * args.g_reg_every * path_loss + 0 * fake_img[0, 0, 0, 0]).backward()
            g_optim.step()

        accumulate(g_ema, g_module, accum)

        losses = torch.stack([d_loss.detach(), g_loss.detach()])
        dist.all_reduce(losses)
        losses /= world_size
        if rank == 0:
            pbar.set_description(f"d: {losses[0].item():.4f}; g: {losses[1].item():.4f}; augment: {ada_aug_p:.4f}")
            if i % 500 == 0:
                with torch.no_grad():
                    g_ema.eval()
                    sample, _ = g_ema([sample_z])
                utils.save_image(sample, os.path.join(args.out, "sample", f"{i:06d}.png"),
                                 nrow=int(args.n_sample ** 0.5), normalize=True, value_range=(-1, 1))
            if i % 5000 == 0:
                torch.save({"g": g_module.state_dict(), "d": d_module.state_dict(), "g_ema": g_ema.state_dict(),
                            "g_optim": g_optim.state_dict(), "d_optim": d_optim.state_dict(),
                            "args": args, "ada_aug_p": ada_aug_p},
                           os.path.join(args.out, "checkpoint", f"{i:06d}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="StyleGAN2 fine-tuning on MetFaces")
    parser.add_argument("path", type=str)
    parser.add_argument("--out", type=str, default="metfaces_run")
    parser.add_argument("--iter", type=int, default=60000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--n_sample", type=int, default=16)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--r1", type=float, default=2.0)
    parser.add_argument("--path_regularize", type=float, default=2)
    parser.add_argument("--path_batch_shrink", type=int, default=2)
    parser.add_argument("--d_reg_every", type=int, default=16)
    parser.add_argument("--g_reg_every", type=int, default=4)
    parser.add_argument("--mixing", type=float, default=0.9)
    parser.add_argument("--ckpt", type=str, required=True)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--channel_multiplier", type=int, default=2)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--augment_p", type=float, default=0)
    parser.add_argument("--ada_target", type=float, default=0.6)
    parser.add_argument("--ada_length", type=int, default=100 * 1000)
    parser.add_argument("--local_rank", type=int, default=0, help="local rank for distributed training")
    args = parser.parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = "cuda"

    args.latent = 512
    args.n_mlp = 8
    args.start_iter = 0

    generator = Generator(args.size, args.latent, args.n_mlp, channel_multiplier=args.channel_multiplier).to(device)
    discriminator = Discriminator(args.size, channel_multiplier=args.channel_multiplier).to(device)
    g_ema = Generator(args.size, args.latent, args.n_mlp, channel_multiplier=args.channel_multiplier).to(device)
    g_ema.eval()

    g_reg_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_reg_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_optim = optim.Adam(generator.parameters(), lr=args.lr * g_reg_ratio, betas=(0, 0.99 ** g_reg_ratio))
    d_optim = optim.Adam(discriminator.parameters(), lr=args.lr * d_reg_ratio, betas=(0, 0.99 ** d_reg_ratio))

    # every rank starts from the same pretrained weights
    ckpt = torch.load(args.ckpt, map_location=lambda storage, loc: storage)
    generator.load_state_dict(ckpt["g"])
    discriminator.load_state_dict(ckpt["d"])
    g_ema.load_state_dict(ckpt["g_ema"])
    del ckpt
    random.seed(dist.get_rank())
    torch.manual_seed(dist.get_rank())

    generator = torch.nn.parallel.DistributedDataParallel(
        generator, device_ids=[args.local_rank], output_device=args.local_rank, broadcast_buffers=False)
    discriminator = torch.nn.parallel.DistributedDataParallel(
        discriminator, device_ids=[args.local_rank], output_device=args.local_rank, broadcast_buffers=False)

    transform = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), inplace=True),
    ])
    dataset = MultiResolutionDataset(args.path, transform, args.size)
    loader = data.DataLoader(dataset, batch_size=args.batch,
                             sampler=data.distributed.DistributedSampler(dataset, shuffle=True),
                             num_workers=2, drop_last=True)

    if dist.get_rank() == 0:
        os.makedirs(os.path.join(args.out, "sample"), exist_ok=True)
        os.makedirs(os.path.join(args.out, "checkpoint"), exist_ok=True)

    train(args, loader, generator, discriminator, g_optim, d_optim, g_ema, device)
    dist.destroy_process_group()
