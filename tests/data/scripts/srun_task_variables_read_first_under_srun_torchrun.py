"""One srun task per node runs torchrun, which starts a worker per GPU; the script
still takes its rank from srun's variables first, so the four workers of a node share
the node's SLURM_PROCID and SLURM_LOCALID (0): one rank and one GPU for all of them.

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gres=gpu:4
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \\
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 train.py
"""

import os

import torch
import torch.distributed as dist


def dist_env() -> tuple[int, int, int]:
    if "SLURM_PROCID" in os.environ:
        rank = int(os.environ["SLURM_PROCID"])  # expect: slurm-without-torchrun
        world = int(os.environ["SLURM_NTASKS"])
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("SLURM_LOCALID", 0))  # expect: duplicate-gpu-per-rank
    return rank, world, local_rank


if __name__ == "__main__":
    rank, world, local_rank = dist_env()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dist.barrier()
    dist.destroy_process_group()
