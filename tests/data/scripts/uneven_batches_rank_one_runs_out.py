"""Rank 1 has fewer batches: it leaves the loop and waits in a barrier while rank 0 is still in all_reduce."""
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    batches = [torch.ones(2)] * (4 if rank == 0 else 2)
    print(f"rank {rank} has {len(batches)} batches", flush=True)
    for batch in batches:
        dist.all_reduce(batch)  # expect: uneven-inputs
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
