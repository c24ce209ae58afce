# Convolutional VAE on FashionMNIST, DistributedDataParallel on one machine with mp.spawn.
#
#   python 20_fashion_vae_spawn.py --epochs 50 --latent 32
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


class ConvVAE(nn.Module):
    def __init__(self, latent=32):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(1, 32, 4, 2, 1), nn.ReLU(),   # 14x14
            nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(),  # 7x7
            nn.Flatten(),
        )
        self.mu = nn.Linear(64 * 7 * 7, latent)
        self.logvar = nn.Linear(64 * 7 * 7, latent)
        self.dec_in = nn.Linear(latent, 64 * 7 * 7)
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(),
            nn.ConvTranspose2d(32, 1, 4, 2, 1),
        )

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z):
        return self.dec(self.dec_in(z).view(-1, 64, 7, 7))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def vae_loss(recon_logits, x, mu, logvar):
    bce = F.binary_cross_entropy_with_logits(recon_logits, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def train(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tf = transforms.ToTensor()
    train_set = datasets.FashionMNIST(args.data, train=True, transform=tf)
    test_set = datasets.FashionMNIST(args.data, train=False, transform=tf)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=512, sampler=test_sampler, num_workers=2)

    model = DDP(ConvVAE(args.latent).to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            recon, mu, logvar = model(x)
            loss = vae_loss(recon, x, mu, logvar) / x.size(0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot[0] += loss.detach() * x.size(0)
            tot[1] += x.size(0)
        dist.all_reduce(tot)

        model.eval()
        test_tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, _ in test_loader:
                x = x.to(device)
                recon, mu, logvar = model(x)
                test_tot[0] += vae_loss(recon, x, mu, logvar)
                test_tot[1] += x.size(0)
        dist.all_reduce(test_tot)

        if rank == 0:
            print(f"epoch {epoch}: train {(tot[0] / tot[1]).item():.2f} "
                  f"test {(test_tot[0] / test_tot[1]).item():.2f} ({time.time() - t0:.1f}s)")
            with torch.no_grad():
                z = torch.randn(64, args.latent, device=device)
                samples = torch.sigmoid(model.module.decode(z))
            save_image(samples, os.path.join(args.out, f"sample_{epoch:03d}.png"), nrow=8)
            torch.save(model.module.state_dict(), os.path.join(args.out, "vae.pt"))

    dist.destroy_process_group()


parser = argparse.ArgumentParser()
parser.add_argument("--data", default="./data")
parser.add_argument("--out", default="./vae_out")
parser.add_argument("--epochs", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--latent", type=int, default=32)
parser.add_argument("--port", type=int, default=29517)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

os.makedirs(args.out, exist_ok=True)
datasets.FashionMNIST(args.data, train=True, download=True)
datasets.FashionMNIST(args.data, train=False, download=True)
world_size = torch.cuda.device_count()
print(f"spawning {world_size} workers")
mp.spawn(train, args=(world_size, args), nprocs=world_size, join=True)
