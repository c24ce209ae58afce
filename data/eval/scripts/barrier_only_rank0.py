"""Rank 0 saves a checkpoint and waits at a barrier that the other ranks never reach."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=15))
    rank = int(os.environ["RANK"])
    model = DDP(nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    if rank == 0:
        torch.save(model.module.state_dict(), "/tmp/eval_ckpt.pt")
        dist.barrier()
    print(f"rank {rank} finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
