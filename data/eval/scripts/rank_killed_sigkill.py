"""Rank 1 is killed with SIGKILL, as the kernel's OOM killer does."""

import os
import signal
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cache = [torch.randn(256, 1024) for _ in range(16)]  # a per-rank copy of the dataset
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5)
    print(rank, len(cache))


if __name__ == "__main__":
    main()
