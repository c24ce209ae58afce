"""A multi-head encoder whose blocks are activation-checkpointed, under DDP
with find_unused_parameters=True (one head is skipped each step).

torchrun --nproc_per_node=2 checkpoint_reentrant_with_unused_parameters.py
torch.utils.checkpoint without use_reentrant runs the reentrant variant: DDP
finds the checkpointed blocks' parameters missing from the forward graph,
marks them ready as unused, and the recomputation in backward marks them
again: "Expected to mark a variable ready only once".
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


class Encoder(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.heads = nn.ModuleDict({"coarse": nn.Linear(width, 4), "fine": nn.Linear(width, 16)})

    def forward(self, x, task):
        x = checkpoint_sequential(self.stem, 2, x)  # expect: ddp-reentrant-checkpoint
        for block in self.blocks:
            x = checkpoint(block, x)  # expect: ddp-reentrant-checkpoint
        return self.heads[task](x)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    model = DDP(Encoder(), find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(4):
        task = "coarse" if step % 2 == 0 else "fine"
        inputs = torch.randn(8, 32, requires_grad=True)
        loss = model(inputs, task).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if local_rank == 0:
        print("trained")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
