"""The same rank-0 evaluation, through the module DDP wraps (`model.module`):
a plain forward, no collective, while the other ranks wait in the barrier (no
finding expected).

Runs under torchrun to the end.
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor]) -> float:
    model.eval()
    total = sum(model(batch).sum().item() for batch in batches)
    model.train()
    return total


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    val_batches = [torch.randn(8, 4) for _ in range(2)]
    for epoch in range(2):
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} val {evaluate(model.module, val_batches):.3f}", flush=True)
        dist.barrier()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
