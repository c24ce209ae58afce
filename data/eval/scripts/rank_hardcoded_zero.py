"""Every process claims rank 0 (a leftover from single-GPU debugging)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=0, world_size=world_size, timeout=timedelta(seconds=15))
    t = torch.arange(4, dtype=torch.float32)
    dist.all_reduce(t)
    print(t)


if __name__ == "__main__":
    main()
