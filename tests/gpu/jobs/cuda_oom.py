"""A batch far larger than the GPU: CUDA out of memory on the first forward."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(4096, 4096).cuda(), device_ids=[local_rank])
    batch = torch.randn(50_000_000, 4096, device="cuda")  # about 763 GiB
    model(batch).sum().backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
