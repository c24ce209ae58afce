"""The same elastic launch and ZeRO-style optimizer, saved the world-size-free way:
the shards are consolidated on rank 0, which writes one full state, and every
rank loads the full state, which the optimizer partitions for the world size it
now has (no finding expected):

    torchrun --nnodes=1:4 --nproc_per_node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HOST:29400 train.py

Runs under torchrun, twice: with two ranks, then resumed with one.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

CHECKPOINT = "optim_full.pt"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)))
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
    )
    if os.path.exists(CHECKPOINT):
        optimizer.load_state_dict(torch.load(CHECKPOINT, map_location="cpu"))
        print("resumed", flush=True)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(optimizer.state_dict(), CHECKPOINT)
    dist.barrier()
    print("saved", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
