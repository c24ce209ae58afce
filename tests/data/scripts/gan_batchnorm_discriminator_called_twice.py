"""A GAN whose BatchNorm discriminator, wrapped in DDP with the default
broadcast_buffers=True, scores the real and the fake batch in two calls
before one backward. Each forward copies rank 0's running statistics in
place; on PyTorch before pytorch/pytorch#175851 (2026) backward fails with
"one of the variables needed for gradient computation has been modified by
an inplace operation". Runs on CPU ranks (gloo)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def block(features):
    return nn.Sequential(nn.Linear(features, features), nn.BatchNorm1d(features), nn.LeakyReLU(0.2))


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), block(16))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    generator = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh()))
    disc = DDP(Discriminator())
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    for _ in range(3):
        real = torch.randn(16, 8)
        fake = generator(torch.randn(16, 4))
        d_real = disc(real)
        d_fake = disc(fake.detach())  # expect: ddp-broadcast-buffers-inplace
        loss_d = (d_real - 1).pow(2).mean() + d_fake.pow(2).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = (disc(fake) - 1).pow(2).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
    print(f"trained rank {dist.get_rank()}")
    del generator, disc  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
