"""Rank 2's data loading stalls; a monitored_barrier names the rank that is late."""

import time
from datetime import timedelta

import torch.distributed as dist


def load_shard(rank):
    if rank == 2:
        time.sleep(30)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_shard(rank)
    dist.monitored_barrier(timeout=timedelta(seconds=8))
    print(f"rank {rank} passed the barrier")


if __name__ == "__main__":
    main()
