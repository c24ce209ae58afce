"""StyleGAN2 + adaptive discriminator augmentation on AFHQ-dog 512.

    torchrun --nproc_per_node=8 train_ada.py /data/afhq_dog_lmdb --size 512 --batch 4 --augment
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
from torch import autograd, optim
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import data
from torchvision import transforms, utils
from tqdm import tqdm

import wandb
from dataset import MultiResolutionDataset
from model import Discriminator, Generator
from non_leaking import augment


class AdaptiveAugment:
    """Tunes the augmentation probability p from the sign of D(real), as in Karras et al. 2020."""

    def __init__(self, target, length, update_every):
        self.target = target
        self.length = length
        self.update_every = update_every
        self.p = 0.0
        self.r_t = 0.0
        self.buf = torch.zeros(2)
        self.step = 0

    @torch.no_grad()
    def tune(self, real_pred):
        self.buf += torch.tensor((torch.sign(real_pred).sum().item(), real_pred.shape[0]))
        self.step += 1
        if self.step % self.update_every == 0:
            dist.all_reduce(self.buf)
            pred_signs, n_pred = self.buf.tolist()
            self.r_t = pred_signs / n_pred
            sign = 1 if self.r_t > self.target else -1
            self.p += sign * n_pred / self.length
            self.p = min(1.0, max(0.0, self.p))
            self.buf.mul_(0)
            self.step = 0
        return self.p


def requires_grad(model, flag=True):
    for p in model.parameters():
        p.requires_grad = flag


@torch.no_grad()
def accumulate(ema, model, decay):
    ema_params = dict(ema.named_parameters())
    for k, v in model.named_parameters():
        ema_params[k].mul_(decay).add_(v, alpha=1 - decay)


def sample_data(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def mixing_noise(batch, latent_dim, prob, device):
    if prob > 0 and random.random() < prob:
        return list(torch.randn(2, batch, latent_dim, device=device).unbind(0))
    return [torch.randn(batch, latent_dim, device=device)]


def d_r1_loss(real_pred, real_img):
    (grad_real,) = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


def g_path_regularize(fake_img, latents, mean_path_length, decay=0.01):
    noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[2] * fake_img.shape[3])
    (grad,) = autograd.grad(outputs=(fake_img * noise).sum(), inputs=latents, create_graph=True)
    path_lengths = torch.sqrt(grad.pow(2).sum(2).mean(1))
    path_mean = mean_path_length + decay * (path_lengths.mean() - mean_path_length)
    return (path_lengths - path_mean).pow(2).mean(), path_mean.detach()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=str)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iter", type=int, default=400000)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--r1", type=float, default=10.0)
    parser.add_argument("--path_regularize", type=float, default=2.0)
    parser.add_argument("--path_batch_shrink", type=int, default=2)
    parser.add_argument("--d_reg_every", type=int, default=16)
    parser.add_argument("--g_reg_every", type=int, default=4)
    parser.add_argument("--mixing", type=float, default=0.9)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--ada_target", type=float, default=0.6)
    parser.add_argument("--ada_length", type=int, default=500 * 1000)
    parser.add_argument("--ada_every", type=int, default=256)
    parser.add_argument("--ckpt", type=str, default=None)
    parser.add_argument("--out", type=str, default="checkpoint_afhq")
    parser.add_argument("--wandb", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    latent, n_mlp = 512, 8

    torch.manual_seed(0)
    generator = Generator(args.size, latent, n_mlp, channel_multiplier=2).to(device)
    discriminator = Discriminator(args.size, channel_multiplier=2).to(device)
    g_ema = Generator(args.size, latent, n_mlp, channel_multiplier=2).to(device)
    g_ema.eval()
    accumulate(g_ema, generator, 0)
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)

    g_ratio = args.g_reg_every / (args.g_reg_every + 1)
    d_ratio = args.d_reg_every / (args.d_reg_every + 1)
    g_optim = optim.Adam(generator.parameters(), lr=args.lr * g_ratio, betas=(0, 0.99 ** g_ratio))
    d_optim = optim.Adam(discriminator.parameters(), lr=args.lr * d_ratio, betas=(0, 0.99 ** d_ratio))

    start_iter = 0
    ada = AdaptiveAugment(args.ada_target, args.ada_length, args.ada_every)
    if args.ckpt is not None:
        ckpt = torch.load(args.ckpt, map_location=lambda storage, loc: storage)
        start_iter = int(os.path.basename(args.ckpt).split(".")[0])
        generator.load_state_dict(ckpt["g"])
        discriminator.load_state_dict(ckpt["d"])
        g_ema.load_state_dict(ckpt["g_ema"])
        g_optim.load_state_dict(ckpt["g_optim"])
        d_optim.load_state_dict(ckpt["d_optim"])
        ada.p = ckpt.get("ada_aug_p", 0.0)

    generator = DDP(generator, device_ids=[local_rank], output_device=local_rank, broadcast_buffers=False)
    discriminator = DDP(discriminator, device_ids=[local_rank], output_device=local_rank, broadcast_buffers=False)

    transform = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), inplace=True),
    ])
    dataset = MultiResolutionDataset(args.path, transform, args.size)
    sampler = data.distributed.DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = sample_data(data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=4,
                                         pin_memory=True, drop_last=True), sampler)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        if args.wandb:
            wandb.init(project="stylegan2-ada-afhq", config=vars(args))

    accum = 0.5 ** (32 / (10 * 1000))
    ada_aug_p = ada.p
    mean_path_length = 0.0
    r1_loss = torch.zeros((), device=device)
    path_loss = torch.zeros((), device=device)
    sample_z = torch.randn(16, latent, device=device)
    pbar = tqdm(range(start_iter, args.iter), dynamic_ncols=True, disable=rank != 0)

    for i in pbar:
        real_img = next(loader).to(device, non_blocking=True)

        requires_grad(generator, False)
        requires_grad(discriminator, True)
        fake_img, _ = generator(mixing_noise(args.batch, latent, args.mixing, device))
        if args.augment:
            real_img_aug, _ = augment(real_img, ada_aug_p)
            fake_img, _ = augment(fake_img, ada_aug_p)
        else:
            real_img_aug = real_img
        fake_pred = discriminator(fake_img)
        real_pred = discriminator(real_img_aug)
        d_loss = F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()
        discriminator.zero_grad(set_to_none=True)
        d_loss.backward()
        d_optim.step()

        if args.augment:
            ada_aug_p = ada.tune(real_pred)

        if i % args.d_reg_every == 0:
            real_img.requires_grad = True
            real_img_aug = augment(real_img, ada_aug_p)[0] if args.augment else real_img
            real_pred = discriminator(real_img_aug)
            r1_loss = d_r1_loss(real_pred, real_img)
            discriminator.zero_grad(set_to_none=True)
            (args.r1 / 2 * r1_loss * args.d_reg_every + 0 * real_pred[0]).backward()
            d_optim.step()

        requires_grad(generator, True)
        requires_grad(discriminator, False)
        fake_img, _ = generator(mixing_noise(args.batch, latent, args.mixing, device))
        if args.augment:
            fake_img, _ = augment(fake_img, ada_aug_p)
        g_loss = F.softplus(-discriminator(fake_img)).mean()
        generator.zero_grad(set_to_none=True)
        g_loss.backward()
        g_optim.step()

        if i % args.g_reg_every == 0:
            pbs = max(1, args.batch // args.path_batch_shrink)
            fake_img, latents = generator(mixing_noise(pbs, latent, args.mixing, device), return_latents=True)
            path_loss, mean_path_length = g_path_regularize(fake_img, latents, mean_path_length)
            generator.zero_grad(set_to_none=True)
            (args.path_regularize * args.g_reg_every * path_loss + 0 * fake_img[0, 0, 0, 0]).backward()
            g_optim.step()

        accumulate(g_ema, generator.module, accum)

        if i % 100 == 0:
            logs = torch.stack([d_loss.detach(), g_loss.detach(), r1_loss.detach(), path_loss.detach(),
                                real_pred.detach().mean()])
            dist.all_reduce(logs)
            logs /= world_size
            if rank == 0:
                d_val, g_val, r1_val, pl_val, real_score = logs.tolist()
                pbar.set_description(f"d {d_val:.3f} g {g_val:.3f} r1 {r1_val:.3f} pl {pl_val:.3f} p {ada_aug_p:.3f}")
                if args.wandb:
                    wandb.log({"D": d_val, "G": g_val, "R1": r1_val, "Path": pl_val, "Real score": real_score,
                               "Augment p": ada_aug_p, "r_t": ada.r_t}, step=i)

        if rank == 0 and i % 2000 == 0:
            with torch.no_grad():
                sample, _ = g_ema([sample_z])
            utils.save_image(sample, os.path.join(args.out, "samples", f"{i:06d}.png"), nrow=4,
                             normalize=True, value_range=(-1, 1))
        if rank == 0 and i % 10000 == 0:
            torch.save({"g": generator.module.state_dict(), "d": discriminator.module.state_dict(),
                        "g_ema": g_ema.state_dict(), "g_optim": g_optim.state_dict(),
                        "d_optim": d_optim.state_dict(), "args": vars(args), "ada_aug_p": ada_aug_p},
                       os.path.join(args.out, f"{i:06d}.pt"))

    if rank == 0 and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
