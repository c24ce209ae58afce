"""Reentrant checkpointing kept, made safe for DDP with static_graph=True:
a shared block checkpointed in a loop, and a head unused on every step
(no finding expected)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Refiner(nn.Module):
    def __init__(self, width=16, steps=3):
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.unused_head = nn.Linear(width, 2)
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = checkpoint(self.shared, x, use_reentrant=True)
        return x


def main():
    dist.init_process_group("gloo")
    model = DDP(Refiner(), static_graph=True, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(4, 16, requires_grad=True)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
