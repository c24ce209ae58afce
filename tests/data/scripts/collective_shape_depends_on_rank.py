"""Every rank calls the collective, but each passes a tensor of its own shape or dtype.

Rank 0 reduces one element and rank 1 two: on gloo (torch 2.13, 2 CPU ranks) both
wait until "Timed out waiting 20000ms for send operation to complete"; NCCL hangs
or reads past the buffer. The sizes come from the rank directly, through a name,
from RANK in the environment, or as the length of a list.
"""

import os

import torch
import torch.distributed as dist


def metrics(rank: int) -> None:
    t = torch.zeros(rank + 1)
    dist.all_reduce(t)  # expect: collective-mismatch
    dist.all_reduce(torch.ones(10 if rank == 0 else 5))  # expect: collective-mismatch


def gather_features(world_size: int) -> None:
    me = int(os.environ["RANK"])
    rows = 2 * me + 4
    features = torch.randn(rows, 8)
    out = [torch.empty(4, 8) for _ in range(world_size)]
    dist.all_gather(out, features)  # expect: collective-mismatch


def exchange(world_size: int) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    buckets = []
    for _ in range(local_rank + 1):
        buckets.append(torch.zeros(4))
    dist.reduce_scatter(torch.zeros(4), buckets)  # expect: collective-mismatch
    half = torch.ones(4).to(torch.float16 if dist.get_rank() == 0 else torch.float32)
    dist.broadcast(half, src=0)  # expect: collective-mismatch


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    metrics(rank)
    gather_features(world_size)
    exchange(world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
