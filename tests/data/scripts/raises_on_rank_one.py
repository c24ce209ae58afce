"""Rank 1 raises a ValueError after init; rank 0 goes on to a barrier."""
import os

import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        raise ValueError("bad batch shape on rank one")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
# lint: no findings (the failure happens at run time; nothing in the source shows it)
