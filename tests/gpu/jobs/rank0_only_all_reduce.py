"""Only rank 0 reduces on NCCL; rank 1 goes on to a barrier of a gloo group: the job hangs."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=float(os.environ.get("JOB_TIMEOUT_SECONDS", "600")))


def main():
    dist.init_process_group("nccl", timeout=TIMEOUT)
    rank = dist.get_rank()
    host_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    if rank == 0:
        torch.cuda.set_device(0)
        metric = torch.ones(1, device="cuda")
        dist.all_reduce(metric)  # rank 1 never joins
        print(f"rank 0: {metric.item()}", flush=True)
    dist.barrier(group=host_group)
    print(f"rank {rank}: past the barrier", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
