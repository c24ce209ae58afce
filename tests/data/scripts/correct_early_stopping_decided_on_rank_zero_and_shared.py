"""Early stopping decided on rank 0, where the validation runs, and shared:
rank 0 broadcasts its decision every epoch, so both ranks leave the epoch
loop at the same epoch and the job ends cleanly.
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
        stop = torch.tensor([int(rank == 0 and bad_epochs >= patience)])
        dist.broadcast(stop, src=0)
        if stop.item():
            print(f"rank {rank} stopped early at epoch {epoch}", flush=True)
            break
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
