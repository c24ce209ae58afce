"""Rank and world size from srun's variables, the GPU from torchrun's LOCAL_RANK:
under `srun python train.py` every task on a node lands on GPU 0. Or the GPU from
the task's index in the whole job: from the second node on, a GPU the node lacks."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def init_distributed():
    if "SLURM_PROCID" in os.environ:
        rank = int(os.environ["SLURM_PROCID"])
        world_size = int(os.environ["SLURM_NTASKS"])
    else:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # expect: slurm-without-torchrun
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return local_rank


def setup_from_ntasks():
    """World size from srun, rank and GPU from torchrun's names: every task is rank 0 on GPU 0."""
    world_size = int(os.environ.get("SLURM_NTASKS", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # expect: slurm-without-torchrun
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank)


def setup_gpu_from_the_task_index(args):
    args.rank = int(os.environ["SLURM_PROCID"])
    args.gpu = args.rank
    torch.cuda.set_device(args.gpu)  # expect: slurm-without-torchrun


def main():
    local_rank = init_distributed()
    model = DDP(nn.Linear(4, 1).cuda(), device_ids=[local_rank])
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
