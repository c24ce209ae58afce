"""Under srun the GPU comes from the Slurm rank, under torchrun from LOCAL_RANK."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def init_distributed():
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        rank = int(os.environ["SLURM_PROCID"])
        world_size = int(os.environ["SLURM_NTASKS"])
        local_rank = rank % torch.cuda.device_count()
    else:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return local_rank


def init_distributed_mode(args):
    """torchvision's references: torchrun's variables first, then srun's."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    elif "SLURM_PROCID" in os.environ:
        args.rank = int(os.environ["SLURM_PROCID"])
        args.gpu = args.rank % torch.cuda.device_count()
    torch.cuda.set_device(args.gpu)


def main():
    local_rank = init_distributed()
    model = DDP(nn.Linear(4, 1).cuda(), device_ids=[local_rank])
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
