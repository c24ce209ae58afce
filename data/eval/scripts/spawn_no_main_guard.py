"""Spawns two workers at module level (no `if __name__ == "__main__":`)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("EVAL_PORT", "12355")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    net = nn.parallel.DistributedDataParallel(nn.Linear(10, 10))
    net(torch.randn(20, 10)).sum().backward()
    dist.destroy_process_group()


world_size = 2
mp.spawn(worker, args=(world_size,), nprocs=world_size, join=True)
