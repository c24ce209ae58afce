"""A Horovod script ported to torch.distributed keeps its `hvd` helpers: the
checkpoint is saved under `if hvd.rank() == 0:`, rank 0 only."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class hvd:  # noqa: N801 - the name the ported code still calls
    @staticmethod
    def init():
        dist.init_process_group("nccl")

    @staticmethod
    def rank():
        return dist.get_rank()

    @staticmethod
    def local_rank():
        return int(os.environ["LOCAL_RANK"])


def main():
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    model = DDP(nn.Linear(4, 1).cuda(), device_ids=[hvd.local_rank()])
    for epoch in range(3):
        model(torch.randn(8, 4, device="cuda")).sum().backward()
        if hvd.rank() == 0:
            torch.save(model.module.state_dict(), f"checkpoints/epoch_{epoch}.pt")
        dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
