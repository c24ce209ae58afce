"""An accuracy helper that all-reduces its counts unless told not to, called on
rank 0 alone for the final test with the flag left at its default: rank 0
waits in the all_reduce for ranks that never call it."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def accuracy(model, batches, reduce=True):
    counts = torch.zeros(2)
    for x, y in batches:
        counts[0] += (model(x).argmax(1) == y).sum()
        counts[1] += y.numel()
    if reduce:
        dist.all_reduce(counts)  # expect: collective-mismatch
    return (counts[0] / counts[1]).item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Linear(4, 3))
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    if rank == 0:
        print("test accuracy", accuracy(model.module, batches))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
