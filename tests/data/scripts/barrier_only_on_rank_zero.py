import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def save_checkpoint(model, path):
    torch.save(model.module.state_dict(), path)
    dist.barrier()  # expect: collective-mismatch


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    model = DDP(nn.Linear(6, 6))
    for step in range(5):
        model(torch.randn(2, 6)).sum().backward()
        if rank == 0:
            save_checkpoint(model, f"step{step}.pt")
    metric = torch.tensor([1.0])
    if dist.get_rank() == 0:
        dist.all_reduce(metric)  # expect: collective-mismatch
        print(metric)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
