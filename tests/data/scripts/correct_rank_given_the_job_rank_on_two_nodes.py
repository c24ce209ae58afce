"""A job for several nodes that passes the job-wide RANK as its rank (LOCAL_RANK
only picks the device): on two nodes of one process each, ranks 0 and 1 meet."""

import datetime
import os

import torch
import torch.distributed as dist


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=10),
    )
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sees {int(total.item())} processes", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
