import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = DDP(nn.Linear(10, 10))
    model(torch.randn(4, 10)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def main():
    world_size = 2
    mp.spawn(train, args=(world_size,), nprocs=world_size)


main()  # expect: missing-main-guard
