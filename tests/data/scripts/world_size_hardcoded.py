import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl",
        init_method="env://",
        world_size=2,  # expect: world-size-mismatch
        rank=0,  # expect: world-size-mismatch
    )
    model = DDP(nn.Linear(3, 3).to(local_rank), device_ids=[local_rank])
    model(torch.ones(1, 3, device=local_rank)).sum().backward()


if __name__ == "__main__":
    main()
