"""Two machines with one GPU each, torchrun on both: the GPU index is the
process's rank in the whole job, so the process on the second machine (rank 1)
asks for cuda:1, which that machine does not have (invalid device ordinal).

    machine A: torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=10.0.0.1 train.py
    machine B: torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 --master_addr=10.0.0.1 train.py

Linted only: the mistake needs GPUs on two machines.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)  # expect: local-rank-not-from-env
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(8, 2).cuda(), device_ids=[torch.cuda.current_device()])
    model(torch.randn(4, 8).cuda()).sum().backward()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
