"""Only rank 0 issues an all_reduce; rank 1 goes on and waits in a later barrier."""
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    print(f"rank {rank} ready", flush=True)
    if rank == 0:
        total = torch.ones(4)
        dist.all_reduce(total)  # expect: collective-mismatch
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
