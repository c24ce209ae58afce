"""A tensor-parallel model written by hand: each rank holds half of a row-parallel
layer, whose forward all-reduces the partial outputs. Every rank runs the
validation forward together, and rank 0 alone prints it."""

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
        return sum(model(x).pow(2).mean().item() for x in batches) / len(batches)


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
        if step == 1:
            val = evaluate(model, batches)
            if rank == 0:
                print(f"val {val:.3f}", flush=True)
    print(f"rank {rank} trained 4 steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
