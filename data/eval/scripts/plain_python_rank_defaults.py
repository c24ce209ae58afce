"""Falls back to defaults for RANK / WORLD_SIZE but never sets the master address."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

rank = int(os.environ.get("RANK", "0"))
world_size = int(os.environ.get("WORLD_SIZE", "2"))


def main():
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    grads = torch.full((8,), float(rank))
    dist.all_reduce(grads)
    print(grads)


if __name__ == "__main__":
    main()
