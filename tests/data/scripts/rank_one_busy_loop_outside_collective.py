"""Rank 1 computes forever in its own loop (its stack keeps moving) while rank 0 waits in all_reduce."""
from datetime import timedelta

import torch
import torch.distributed as dist


def endless_augmentation():
    total = 0
    while True:
        total += sum(range(1000))


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        endless_augmentation()
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
# lint: no findings (the failure happens at run time; nothing in the source shows it)
