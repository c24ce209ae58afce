"""Rank 1 is stuck in its own code (a sleep) while rank 0 waits in all_reduce."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def slow_preprocessing():
    time.sleep(3600)


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        slow_preprocessing()
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
# lint: no findings (the failure happens at run time; nothing in the source shows it)
