"""The head is added on every rank, and rank 0 only logs and saves (no finding expected).

Runs under torchrun: every rank builds the same model, DDP's check passes.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model.head = nn.Linear(8, 2)
    if rank == 0:
        model.tag = str(rank)  # an attribute, not a layer
        print("parameters", sum(p.numel() for p in model.parameters()), flush=True)
    model = DDP(model)
    model(torch.randn(4, 8)).sum().backward()
    if rank == 0:
        model.module.add_module("probe", nn.Identity())  # after wrapping: not DDP's check
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
