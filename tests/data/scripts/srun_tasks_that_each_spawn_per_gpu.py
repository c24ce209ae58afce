"""Eight Slurm tasks per node, and each task spawns one process per GPU: every
node runs 64 processes with ranks computed from the node alone, repeated eight
times.

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=8
    #SBATCH --gres=gpu:8
    srun python train.py
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(local_rank: int, ngpus: int) -> None:
    node = int(os.environ["SLURM_NODEID"])
    nodes = int(os.environ["SLURM_NNODES"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl", rank=node * ngpus + local_rank, world_size=nodes * ngpus
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ngpus = torch.cuda.device_count()
    mp.spawn(worker, args=(ngpus,), nprocs=ngpus)  # expect: slurm-without-torchrun
