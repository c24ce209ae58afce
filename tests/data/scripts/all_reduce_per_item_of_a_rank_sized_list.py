"""Each rank all-reduces once per local batch, but the number of batches depends on the rank.

Reduced from forum reports of custom sharding without padding: with 11 examples
on 2 ranks, rank 0 gets 6 steps and rank 1 five, so rank 0 waits in an
all_reduce no other rank calls (a hang until the process group's timeout, or
"Connection closed by peer" once rank 1 exits).
"""

import os

import torch
import torch.distributed as dist


def shard_sizes(total: int, world_size: int, rank: int) -> int:
    return total // world_size + (1 if rank < total % world_size else 0)


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = dist.get_world_size()
    steps = shard_sizes(11, world_size, rank)
    for _ in range(steps):
        grad = torch.ones(4)
        dist.all_reduce(grad)  # expect: uneven-inputs
    losses = [torch.zeros(1) for _ in range(rank + 2)]
    for loss in losses:
        dist.all_reduce(loss)  # expect: uneven-inputs
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
