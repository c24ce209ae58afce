"""A metric all_reduce under `if rank == 0:` while rank 1 goes on training.

Rank 0 waits in an all_reduce that rank 1 never calls, so gloo gives up after
the process-group timeout (10 s here, 30 min by default).
Recorded with: torchrun --nproc-per-node 2 all_reduce_on_rank_zero_only.py
(log: tests/data/logs/all_reduce_rank0_only_gloo_timeout.txt)
"""

import datetime
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    loss = torch.tensor([0.5 + rank])
    if rank == 0:
        dist.all_reduce(loss)  # expect: collective-mismatch
        print(f"mean loss {loss.item() / dist.get_world_size()}")
    time.sleep(20)  # the other ranks' next epoch
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
