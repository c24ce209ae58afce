"""A one-node job started with mp.spawn whose worker picks a free MASTER_PORT itself
(master-endpoint-mismatch).

Each process asks the OS for its own free port, so rank 0's store listens on one
port and the other ranks connect to theirs: init_process_group times out.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(find_free_port())  # expect: master-endpoint-mismatch
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def worker(rank: int, world_size: int) -> None:
    setup(rank, world_size)
    model = DDP(nn.Linear(8, 1))
    model(torch.randn(2, 8)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
