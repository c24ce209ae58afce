"""Computes MASTER_PORT from the rank, so the ranks look for different servers."""

import os
import sys
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world_size, base_port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(base_port + rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=15))
    dist.barrier()


if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
