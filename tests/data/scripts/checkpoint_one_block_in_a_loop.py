"""A weight-shared refinement block applied several times per forward, each
application checkpointed reentrantly, under plain DDP.

torchrun --nproc_per_node=2 checkpoint_one_block_in_a_loop.py
The distinct layers are fine; the shared block's parameters get gradients in
several reentrant backward passes, and DDP stops at the second one:
"Expected to mark a variable ready only once".
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Refiner(nn.Module):
    def __init__(self, width=16, steps=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.shared = nn.Linear(width, width)
        self.steps = steps

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=True)
        for _ in range(self.steps):
            x = checkpoint(self.shared, x, use_reentrant=True)  # expect: ddp-reentrant-checkpoint
        return x


def main():
    dist.init_process_group("gloo")
    model = DDP(Refiner())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 16, requires_grad=True)).sum()
    loss.backward()
    optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
