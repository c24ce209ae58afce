"""Copied from a 4-GPU config: world_size is written into the code."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

WORLD_SIZE = 4


def main():
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        backend="gloo", world_size=WORLD_SIZE, rank=rank, timeout=timedelta(seconds=20)
    )
    x = torch.ones(3) * rank
    dist.all_reduce(x)
    print(rank, x)


if __name__ == "__main__":
    main()
