"""Each process is given its own GPU through CUDA_VISIBLE_DEVICES.

Set before CUDA starts, from the process's rank (here MPI's, as some diffusion
code does), the variable leaves each process one visible GPU, which it calls
cuda:0. Without set_device, `.cuda()` and torch.device("cuda") are still the
process's own GPU. Lint only.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

GPUS_PER_NODE = 8


def setup(rank: int, world_size: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank % GPUS_PER_NODE)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def main():
    rank, world_size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    setup(rank, world_size)
    device = torch.device("cuda")
    model = DDP(nn.Linear(16, 4).to(device), device_ids=[device])
    loss = model(torch.randn(8, 16).cuda()).sum()
    loss.backward()


if __name__ == "__main__":
    main()
