import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.barrier()  # runs on cuda:0 in every rank: the communicator is built there
    torch.cuda.set_device(local_rank)  # expect: set-device-order
    return local_rank


def main():
    local_rank = setup()
    model = DDP(nn.Linear(8, 8).to(local_rank), device_ids=[local_rank])
    model(torch.zeros(4, 8, device=local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
