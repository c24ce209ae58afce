"""Rank 0 alone evaluates after each epoch, through the DDP wrapper, while the
other ranks wait in the barrier: the model has BatchNorm, and DDP (its
broadcast_buffers left on) broadcasts rank 0's buffers at that first forward
after training, a collective the other ranks never join.

Runs under torchrun: the evaluation's forward and the barrier do not match,
and the run fails (on NCCL it hangs until the timeout).
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor]) -> float:
    model.eval()
    total = sum(model(batch).sum().item() for batch in batches)  # expect: collective-mismatch
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
            print(f"epoch {epoch} val {evaluate(model, val_batches):.3f}", flush=True)
        dist.barrier()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
