"""An accuracy helper that all-reduces its counts unless told not to: every
rank calls it for validation (the reduce runs everywhere), and rank 0 alone
calls it for the final test with reduce=False (no collective on that path).
Both ranks print the validation accuracy and finish."""

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
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Linear(4, 3))
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    print(f"[rank {rank}] validation accuracy {accuracy(model.module, batches):.2f}", flush=True)
    if rank == 0:
        print("test accuracy", accuracy(model.module, batches, reduce=False))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
