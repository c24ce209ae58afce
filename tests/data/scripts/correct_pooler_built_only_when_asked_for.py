"""The same generator and discriminator, fixed the way such code is: the encoder
builds its pooler only when the model will ask for it (no finding expected).

Runs under torchrun: every parameter gets a gradient in each backward.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Encoder(nn.Module):
    def __init__(self, width: int, with_pooler: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(8, width)
        self.pooler = nn.Sequential(nn.Linear(width, width), nn.Tanh()) if with_pooler else None

    def forward(self, x: torch.Tensor, return_pooled: bool = False):
        h = torch.relu(self.layer(x))
        if return_pooled:
            return h, self.pooler(h.mean(0, keepdim=True))
        return h


class Electra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = Encoder(4)
        self.discriminator = Encoder(16)
        self.gen_head = nn.Linear(4, 8)
        self.disc_head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = self.gen_head(self.generator(x))
        return self.disc_head(self.discriminator(fake + x)).mean()


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Electra())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        loss = model(torch.randn(8, 8))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
