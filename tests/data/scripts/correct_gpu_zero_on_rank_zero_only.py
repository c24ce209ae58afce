"""GPU 0 named where only rank 0 runs.

Evaluation and sample writing often run on rank 0 alone, and some code moves
their tensors with `.cuda(0)`: GPU 0 is rank 0's own there, so it is not the
"same GPU on every rank" mistake. Lint only.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model, batches):
    with torch.no_grad():
        for batch in batches:
            print(model(batch.cuda(0)).mean().item())


def train(rank: int, model, batches):
    for batch in batches:
        model(batch.cuda(rank)).sum().backward()
    if rank == 0:
        evaluate(model.module, batches)
        torch.save(model.module.state_dict(), "model.pt")


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(16, 4).cuda(rank), device_ids=[rank])
    train(rank, model, [torch.randn(8, 16) for _ in range(3)])


if __name__ == "__main__":
    main()
