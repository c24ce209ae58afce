"""Rank 0 spends a long time writing a checkpoint; the others wait in all_reduce."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def save_checkpoint():
    time.sleep(40)  # a slow network filesystem


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank = dist.get_rank()
    if rank == 0:
        save_checkpoint()
    grad = torch.randn(1024)
    dist.all_reduce(grad)
    print(rank, grad.norm().item())


if __name__ == "__main__":
    main()
