"""One rank stops training early (it sees a NaN loss) while the others keep going."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=15))
    rank = dist.get_rank()
    model = DDP(nn.Linear(4, 1))
    for step in range(6):
        loss = model(torch.randn(3, 4)).mean()
        if rank == 1 and step == 2:
            loss = loss * float("nan")
        if torch.isnan(loss):
            print(f"rank {rank}: NaN loss at step {step}, stopping")
            break
        loss.backward()
    dist.barrier()


if __name__ == "__main__":
    main()
