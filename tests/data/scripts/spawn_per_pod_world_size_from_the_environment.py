"""A pod of a Kubeflow PyTorchJob that spawns one process per GPU itself.

The operator sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in each pod:
RANK is the pod's index and WORLD_SIZE the number of pods. The script counts
each spawned process's global rank as pod rank * processes per pod + index,
but takes WORLD_SIZE as the world: one pod here (WORLD_SIZE=1), two processes
(CPU), so the process with rank 1 is outside the world (gloo: "rank < size";
with several pods, ranks past the pod count never join and the rendezvous
waits until it times out).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(local_rank, ngpus):
    pod_rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    rank = pod_rank * ngpus + local_rank
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)  # expect: world-size-mismatch
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {rank} of {dist.get_world_size()}: {int(total.item())} processes")
    dist.destroy_process_group()


if __name__ == "__main__":
    ngpus = torch.cuda.device_count() or 2  # two CPU processes where there is no GPU
    mp.spawn(run, nprocs=ngpus, args=(ngpus,))
