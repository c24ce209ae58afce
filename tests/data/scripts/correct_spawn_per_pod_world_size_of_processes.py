"""The twin of spawn_per_pod_world_size_from_the_environment.py: the pod's
WORLD_SIZE (the number of pods) is multiplied by the processes each pod spawns,
so every spawned rank is inside the world and the all_reduce counts them all."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(local_rank, ngpus):
    pod_rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"]) * ngpus
    rank = pod_rank * ngpus + local_rank
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {rank} of {dist.get_world_size()}: {int(total.item())} processes")
    dist.destroy_process_group()


if __name__ == "__main__":
    ngpus = torch.cuda.device_count() or 2  # two CPU processes where there is no GPU
    mp.spawn(run, nprocs=ngpus, args=(ngpus,))
