# KL-regularised autoencoder (f=8, z=4) with LPIPS + PatchGAN hinge loss.
# Small re-implementation of the LDM first stage so we can train on our own data.
#
# torchrun --nproc_per_node=4 train_vae.py --config configs/vae_f8.yaml
import argparse
import os
import time

import lpips
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms
from torchvision.utils import make_grid, save_image


def Norm(c):
    return nn.GroupNorm(32, c, eps=1e-6)


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n1, self.c1 = Norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.n2, self.c2 = Norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.silu(self.n1(x)))
        h = self.c2(F.silu(self.n2(h)))
        return self.skip(x) + h


class Encoder(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 4, 4), z=4):
        super().__init__()
        layers = [nn.Conv2d(3, ch, 3, padding=1)]
        cin = ch
        for i, m in enumerate(mult):
            layers += [ResBlock(cin, ch * m), ResBlock(ch * m, ch * m)]
            cin = ch * m
            if i != len(mult) - 1:
                layers.append(nn.Conv2d(cin, cin, 3, stride=2, padding=1))
        layers += [ResBlock(cin, cin), Norm(cin), nn.SiLU(), nn.Conv2d(cin, 2 * z, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 4, 4), z=4):
        super().__init__()
        cin = ch * mult[-1]
        layers = [nn.Conv2d(z, cin, 3, padding=1), ResBlock(cin, cin)]
        for i, m in reversed(list(enumerate(mult))):
            layers += [ResBlock(cin, ch * m), ResBlock(ch * m, ch * m)]
            cin = ch * m
            if i != 0:
                layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(cin, cin, 3, padding=1)]
        layers += [Norm(cin), nn.SiLU(), nn.Conv2d(cin, 3, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z)


class AutoencoderKL(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.encoder = Encoder(**kw)
        self.decoder = Decoder(**kw)

    def forward(self, x, sample=True):
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        logvar = logvar.clamp(-30, 20)
        z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean) if sample else mean
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).sum(dim=[1, 2, 3]).mean()
        return self.decoder(z), kl


class PatchDiscriminator(nn.Module):
    def __init__(self, ch=64, n_layers=3):
        super().__init__()
        layers = [nn.Conv2d(3, ch, 4, 2, 1), nn.LeakyReLU(0.2, True)]
        c = ch
        for i in range(1, n_layers + 1):
            nc = ch * min(2 ** i, 8)
            stride = 2 if i < n_layers else 1
            layers += [nn.Conv2d(c, nc, 4, stride, 1), nn.GroupNorm(32, nc), nn.LeakyReLU(0.2, True)]
            c = nc
        layers.append(nn.Conv2d(c, 1, 4, 1, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def get_loader(cfg, rank, world):
    tf = transforms.Compose([
        transforms.Resize(cfg["resolution"]),
        transforms.RandomCrop(cfg["resolution"]),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    ds = datasets.ImageFolder(cfg["data_root"], transform=tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg["batch_size_per_gpu"], sampler=sampler,
                    num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True,
                    persistent_workers=True)
    return dl, sampler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", default="runs/vae_f8")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 0) + rank)

    vae = AutoencoderKL().to(device)
    disc = PatchDiscriminator().to(device)
    perceptual = lpips.LPIPS(net="vgg").to(device).eval()
    for p_ in perceptual.parameters():
        p_.requires_grad_(False)

    opt_ae = torch.optim.Adam(vae.parameters(), lr=cfg["lr"], betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=cfg["lr"], betas=(0.5, 0.9))

    step, start_epoch = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume)
        vae.load_state_dict(ckpt["vae"])
        disc.load_state_dict(ckpt["disc"])
        opt_ae.load_state_dict(ckpt["opt_ae"])
        opt_d.load_state_dict(ckpt["opt_d"])
        step, start_epoch = ckpt["step"], ckpt["epoch"] + 1
        del ckpt

    vae = DDP(vae, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])

    loader, sampler = get_loader(cfg, rank, world)
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    kl_w, disc_w, disc_start = cfg["kl_weight"], cfg["disc_weight"], cfg["disc_start"]
    fixed = None
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        vae.train()
        disc.train()
        t0 = time.time()
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            if fixed is None:
                fixed = x[:8].clone()

            # autoencoder step
            rec, kl = vae(x)
            rec_l1 = (x - rec).abs().mean()
            p_loss = perceptual(rec, x).mean()
            loss = rec_l1 + cfg["lpips_weight"] * p_loss + kl_w * kl
            use_gan = step >= disc_start
            if use_gan:
                g_loss = -disc(rec).mean()
                loss = loss + disc_w * g_loss
            opt_ae.zero_grad(set_to_none=True)
            loss.backward()
            opt_ae.step()

            # discriminator step
            d_loss = torch.zeros((), device=device)
            if use_gan:
                logits_real = disc(x)
                logits_fake = disc(rec.detach())
                d_loss = 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()

            if step % cfg["log_every"] == 0:
                stats = torch.stack([rec_l1.detach(), p_loss.detach(), kl.detach(), d_loss.detach()])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    for k, v in zip(["rec_l1", "lpips", "kl", "d_loss"], stats.tolist()):
                        writer.add_scalar(f"train/{k}", v, step)
                    print(f"ep {epoch} step {step} l1 {stats[0]:.4f} lpips {stats[1]:.4f} "
                          f"kl {stats[2]:.1f} d {stats[3]:.3f} ({time.time() - t0:.1f}s)", flush=True)
            step += 1

        if rank == 0:
            vae.eval()
            with torch.no_grad():
                rec, _ = vae.module(fixed, sample=False)
            grid = make_grid(torch.cat([fixed, rec]).clamp(-1, 1), nrow=8, normalize=True, value_range=(-1, 1))
            save_image(grid, os.path.join(args.out, f"recon_{epoch:04d}.png"))
            writer.add_image("recon", grid, step)
            torch.save({
                "vae": vae.module.state_dict(),
                "disc": disc.module.state_dict(),
                "opt_ae": opt_ae.state_dict(),
                "opt_d": opt_d.state_dict(),
                "step": step,
                "epoch": epoch,
                "cfg": cfg,
            }, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
