"""A batch far too large for the GPU: the first forward runs out of memory."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(16384, 16384).cuda(), device_ids=[local_rank])
    batch = torch.randn(1_200_000, 16384, device="cuda", dtype=torch.float32)
    model(batch).sum().backward()


if __name__ == "__main__":
    main()
