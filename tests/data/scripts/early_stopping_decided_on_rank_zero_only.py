"""Early stopping decided where the validation runs: rank 0 alone evaluates,
counts the epochs without improvement, and leaves the epoch loop when its
patience runs out. The other rank knows nothing of it and starts another
epoch, whose first backward waits for rank 0 in DDP's gradient all-reduce.

Runs under torchrun: rank 1's all-reduce fails, its peer gone (on NCCL it
hangs until the timeout).
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # a flat validation loss
    val = torch.randn(16, 4)
    best, bad_epochs, patience = float("inf"), 0, 2
    for epoch in range(10):
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            with torch.no_grad():
                val_loss = model.module(val).pow(2).mean().item()
            bad_epochs = 0 if val_loss < best else bad_epochs + 1
            best = min(best, val_loss)
        if rank == 0 and bad_epochs >= patience:  # expect: uneven-inputs
            print(f"rank {rank} stopped early at epoch {epoch}", flush=True)
            break
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
