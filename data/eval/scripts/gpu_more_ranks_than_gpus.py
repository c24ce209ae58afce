"""One process per GPU assumed: --nproc_per_node is larger than the GPUs present."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(64, 64).cuda(), device_ids=[local_rank])
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
