"""
Convolutional VAE on CelebA 64x64 with a small Trainer class.

    torchrun --nproc_per_node=4 11_celeba_vae_trainer.py --data /data/celeba --epochs 50
"""
import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
import torchvision.utils as vutils
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from tqdm import tqdm


@dataclass
class Config:
    data: str = "/data/celeba"
    epochs: int = 50
    batch_size: int = 64        # per GPU
    lr: float = 5e-4            # for batch 256 in total
    latent_dim: int = 128
    kld_weight: float = 0.00025
    out_dir: str = "runs/celeba_vae"
    num_workers: int = 8


class VAE(nn.Module):
    def __init__(self, latent_dim=128, hidden=(32, 64, 128, 256, 512)):
        super().__init__()
        self.latent_dim = latent_dim
        enc, c = [], 3
        for h in hidden:
            enc += [nn.Conv2d(c, h, 3, 2, 1), nn.BatchNorm2d(h), nn.LeakyReLU()]
            c = h
        self.encoder = nn.Sequential(*enc)
        self.fc_mu = nn.Linear(hidden[-1] * 4, latent_dim)
        self.fc_var = nn.Linear(hidden[-1] * 4, latent_dim)
        self.decoder_input = nn.Linear(latent_dim, hidden[-1] * 4)
        dec = []
        rev = list(reversed(hidden))
        for a, b in zip(rev[:-1], rev[1:]):
            dec += [nn.ConvTranspose2d(a, b, 3, 2, 1, output_padding=1), nn.BatchNorm2d(b), nn.LeakyReLU()]
        self.decoder = nn.Sequential(*dec)
        self.final = nn.Sequential(
            nn.ConvTranspose2d(rev[-1], rev[-1], 3, 2, 1, output_padding=1), nn.BatchNorm2d(rev[-1]), nn.LeakyReLU(),
            nn.Conv2d(rev[-1], 3, 3, padding=1), nn.Tanh())
        self.hidden_last = hidden[-1]

    def encode(self, x):
        h = torch.flatten(self.encoder(x), 1)
        return self.fc_mu(h), self.fc_var(h)

    def decode(self, z):
        h = self.decoder_input(z).view(-1, self.hidden_last, 2, 2)
        return self.final(self.decoder(h))

    def forward(self, x):
        mu, log_var = self.encode(x)
        std = torch.exp(0.5 * log_var)
        z = mu + std * torch.randn_like(std)
        return self.decode(z), mu, log_var

    @torch.no_grad()
    def sample(self, n, device):
        z = torch.randn(n, self.latent_dim, device=device)
        return self.decode(z)


def vae_loss(recon, x, mu, log_var, kld_weight):
    rec = F.mse_loss(recon, x)
    kld = torch.mean(-0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp(), dim=1))
    return rec + kld_weight * kld, rec.detach(), kld.detach()


class Trainer:
    def __init__(self, cfg: Config, model: nn.Module, train_set):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0

        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        lr = cfg.lr * cfg.batch_size * self.world_size / 256
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.sched = torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=0.95)
        self.sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
        self.loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=self.sampler,
                                 num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
        self.fixed_batch = None
        if self.is_main:
            os.makedirs(os.path.join(cfg.out_dir, "samples"), exist_ok=True)

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        meters = torch.zeros(3, device=self.device)
        for x, _ in tqdm(self.loader, disable=not self.is_main, desc=f"epoch {epoch}"):
            x = x.to(self.device, non_blocking=True)
            if self.fixed_batch is None:
                self.fixed_batch = x[:32].clone()
            recon, mu, log_var = self.model(x)
            loss, rec, kld = vae_loss(recon, x, mu, log_var, self.cfg.kld_weight)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            meters += torch.stack([loss.detach(), rec, kld])
        self.sched.step()
        dist.all_reduce(meters)
        return (meters / (len(self.loader) * self.world_size)).tolist()

    @torch.no_grad()
    def log_images(self, epoch):
        self.model.eval()
        samples = self.model.sample(64, self.device)
        recon, _, _ = self.model.module(self.fixed_batch)
        grid = torch.cat([self.fixed_batch, recon], 0)
        vutils.save_image(samples * 0.5 + 0.5, os.path.join(self.cfg.out_dir, "samples", f"sample_{epoch:03d}.png"), nrow=8)
        vutils.save_image(grid * 0.5 + 0.5, os.path.join(self.cfg.out_dir, "samples", f"recon_{epoch:03d}.png"), nrow=8)

    def save(self, epoch):
        torch.save({"epoch": epoch, "model": self.model.module.state_dict(), "opt": self.opt.state_dict()},
                   os.path.join(self.cfg.out_dir, "vae_last.pt"))

    def fit(self):
        for epoch in range(self.cfg.epochs):
            loss, rec, kld = self.train_epoch(epoch)
            if self.is_main:
                print(f"epoch {epoch}: loss {loss:.5f} rec {rec:.5f} kld {kld:.3f}")
                self.log_images(epoch)
                self.save(epoch)
            dist.barrier()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=Config.data)
    p.add_argument("--epochs", type=int, default=Config.epochs)
    p.add_argument("--batch_size", type=int, default=Config.batch_size)
    p.add_argument("--out_dir", default=Config.out_dir)
    a = p.parse_args()
    cfg = Config(data=a.data, epochs=a.epochs, batch_size=a.batch_size, out_dir=a.out_dir)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)

    tf = T.Compose([T.CenterCrop(148), T.Resize(64), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = ImageFolder(cfg.data, transform=tf)
    Trainer(cfg, VAE(cfg.latent_dim), train_set).fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
