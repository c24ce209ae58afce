"""Reduced from pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py.

set_device comes after init_process_group but before any collective: NCCL
creates its communicator lazily, at DDP's first broadcast, on the right GPU.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup():
    dist.init_process_group(backend="nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def main():
    ddp_setup()
    local_rank = int(os.environ["LOCAL_RANK"])
    model = DDP(nn.Linear(8, 8).to(local_rank), device_ids=[local_rank])
    model(torch.zeros(4, 8, device=local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
