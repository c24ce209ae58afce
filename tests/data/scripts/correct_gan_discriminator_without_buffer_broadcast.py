"""The GAN of gan_batchnorm_discriminator_called_twice.py with its twin fix:
the discriminator's DDP is built with broadcast_buffers=False, so its two
forwards before one backward copy nothing in place (the statistics stay each
rank's own, as SyncBatchNorm would keep them in step)."""

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
    disc = DDP(Discriminator(), broadcast_buffers=False)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    for _ in range(3):
        real = torch.randn(16, 8)
        fake = generator(torch.randn(16, 4))
        d_real = disc(real)
        d_fake = disc(fake.detach())
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
