"""Rank 0 adds a head to the model before DDP wraps it (model-differs-across-ranks).

Under torchrun, DDP's construction check sees rank 0 with more parameters
than rank 1 and every rank fails before the first step.
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
    if rank == 0:
        model.head = nn.Linear(8, 2)  # expect: model-differs-across-ranks
    model = DDP(model)
    model(torch.randn(4, 8)).sum().backward()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
