"""A job for several nodes that passes the process's LOCAL_RANK as its rank:
on two nodes of one process each, both processes claim rank 0 and nobody
claims rank 1, so the group never forms (the short timeout lets it fail fast)."""

import datetime
import os

import torch
import torch.distributed as dist


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        rank=local_rank,  # expect: world-size-mismatch
        world_size=world_size,
        timeout=datetime.timedelta(seconds=10),
    )
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sees {int(total.item())} processes", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
