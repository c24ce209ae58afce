"""
Conv VAE on CelebA 64x64, logged to wandb, trained on desktop + laptop.

  desktop (192.168.1.2, RTX 3080):
      torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=192.168.1.2 \
          --master_port=29502 vae_celeba.py --run-name vae-z128
  laptop (RTX 3070 Laptop, ethernet dongle):
      torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 --master_addr=192.168.1.2 \
          --master_port=29502 vae_celeba.py --run-name vae-z128

CelebA img_align_celeba is unpacked under ~/data/celeba on both.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms, utils


class VAE(nn.Module):
    def __init__(self, z_dim=128, ch=64):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(3, ch, 4, 2, 1), nn.BatchNorm2d(ch), nn.LeakyReLU(0.2),
            nn.Conv2d(ch, ch * 2, 4, 2, 1), nn.BatchNorm2d(ch * 2), nn.LeakyReLU(0.2),
            nn.Conv2d(ch * 2, ch * 4, 4, 2, 1), nn.BatchNorm2d(ch * 4), nn.LeakyReLU(0.2),
            nn.Conv2d(ch * 4, ch * 8, 4, 2, 1), nn.BatchNorm2d(ch * 8), nn.LeakyReLU(0.2),
            nn.Flatten(),
        )
        self.fc_mu = nn.Linear(ch * 8 * 16, z_dim)
        self.fc_logvar = nn.Linear(ch * 8 * 16, z_dim)
        self.fc_dec = nn.Linear(z_dim, ch * 8 * 16)
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(ch * 8, ch * 4, 4, 2, 1), nn.BatchNorm2d(ch * 4), nn.ReLU(),
            nn.ConvTranspose2d(ch * 4, ch * 2, 4, 2, 1), nn.BatchNorm2d(ch * 2), nn.ReLU(),
            nn.ConvTranspose2d(ch * 2, ch, 4, 2, 1), nn.BatchNorm2d(ch), nn.ReLU(),
            nn.ConvTranspose2d(ch, 3, 4, 2, 1), nn.Tanh(),
        )
        self.ch = ch

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h).clamp(-10, 10)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        recon = self.dec(self.fc_dec(z).view(-1, self.ch * 8, 4, 4))
        return recon, mu, logvar

    def decode(self, z):
        return self.dec(self.fc_dec(z).view(-1, self.ch * 8, 4, 4))


def vae_loss(recon, x, mu, logvar, beta):
    rec = F.mse_loss(recon, x, reduction="sum") / x.size(0)
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.size(0)
    return rec + beta * kld, rec, kld


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/celeba"))
    ap.add_argument("--run-name", default="vae")
    ap.add_argument("--project", default="celeba-vae")
    ap.add_argument("--z", type=int, default=128)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--kl-warmup", type=int, default=5000, help="steps to ramp beta from 0")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--ckpt-dir", default="checkpoints")
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234 + rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    tf = transforms.Compose([
        transforms.CenterCrop(148),
        transforms.Resize(64),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    ds = datasets.ImageFolder(args.data, transform=tf)  # single dummy class folder
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    model = VAE(z_dim=args.z).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
    fixed_z = torch.randn(64, args.z, device=device, generator=torch.Generator(device).manual_seed(0))
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        ep = torch.zeros(4, device=device)
        for x, _ in dl:
            x = x.to(device, non_blocking=True)
            beta = args.beta * min(1.0, step / args.kl_warmup)
            recon, mu, logvar = model(x)
            loss, rec, kld = vae_loss(recon, x, mu, logvar, beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            ep += torch.stack([loss.detach(), rec.detach(), kld.detach(), torch.ones((), device=device)])
            if step % args.log_every == 0:
                wandb.log({"train/loss": loss.item(), "train/recon": rec.item(), "train/kld": kld.item(),
                           "beta": beta, "lr": sched.get_last_lr()[0]}, step=step)
        sched.step()
        dist.all_reduce(ep)
        ep_loss, ep_rec, ep_kld = (ep[:3] / ep[3]).tolist()

        if rank == 0:
            print(f"epoch {epoch}: loss {ep_loss:.2f} rec {ep_rec:.2f} kld {ep_kld:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            model.eval()
            with torch.no_grad():
                samples = model.module.decode(fixed_z) * 0.5 + 0.5
                recons = torch.cat([x[:8] * 0.5 + 0.5, model.module(x[:8])[0] * 0.5 + 0.5])
            wandb.log({"epoch/loss": ep_loss, "epoch/recon": ep_rec, "epoch/kld": ep_kld,
                       "samples": wandb.Image(utils.make_grid(samples, nrow=8)),
                       "recons": wandb.Image(utils.make_grid(recons, nrow=8))}, step=step)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "step": step}, os.path.join(args.ckpt_dir, f"{args.run_name}.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
