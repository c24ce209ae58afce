"""Trains a small model on a Slurm cluster, started as its docstring says:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    srun python correct_srun_start_with_slurm_variables.py --epochs 10

The fix beside srun_start_with_torchrun_variables.py: the rank and world size
come from srun's own variables (SLURM_PROCID, SLURM_NTASKS), so the eight
tasks form one job.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn


def setup():
    world_size = int(os.environ.get("SLURM_NTASKS", 1))
    rank = int(os.environ.get("SLURM_PROCID", 0))
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return rank, world_size


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    rank, world_size = setup()
    model = nn.Linear(8, 1)
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.epochs):
        loss = model(torch.randn(32, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {rank} of {world_size} done")


if __name__ == "__main__":
    main()
