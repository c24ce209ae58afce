"""mp.spawn with a fixed MASTER_PORT that an earlier, still running job holds."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2, join=True)
