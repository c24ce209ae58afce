"""A tensor-parallel model written by hand: each rank holds half of a row-parallel
layer, whose forward all-reduces the partial outputs. Validation runs on rank 0
alone, so its forward waits in the all-reduce for a rank that went on training."""

import datetime

import torch
import torch.distributed as dist
from torch import nn


class ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowParallelLinear(nn.Module):
    def __init__(self, width, world):
        super().__init__()
        self.part = nn.Linear(width // world, width, bias=False)
        self.world, self.rank = world, dist.get_rank()

    def forward(self, x):
        shard = x.chunk(self.world, dim=-1)[self.rank]
        return ReduceFromTensorParallel.apply(self.part(shard))


def evaluate(model, batches):
    with torch.no_grad():
        return sum(model(x).pow(2).mean().item() for x in batches) / len(batches)  # expect: collective-mismatch


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank reads the same batches
    model = RowParallelLinear(8, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4, 8) for _ in range(4)]
    for step, x in enumerate(batches):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 and rank == 0:
            print(f"val {evaluate(model, batches):.3f}", flush=True)
    print(f"rank {rank} trained 4 steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
