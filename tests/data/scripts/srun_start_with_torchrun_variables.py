"""Trains a small model on a Slurm cluster, started as its docstring says:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    srun python srun_start_with_torchrun_variables.py --epochs 10

It takes its rank and world size from RANK / WORLD_SIZE, which only torchrun
sets: under srun every task falls back to rank 0 of a world of 1, never joins
a process group, and trains alone, eight copies of one run.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn


def setup():
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # expect: slurm-without-torchrun
    rank = int(os.environ.get("RANK", 0))
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
