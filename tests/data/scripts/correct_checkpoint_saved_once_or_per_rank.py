"""Checkpoints saved the ways that do not race.

Rank 0 alone saves the model (nanoGPT's `master_process` flag), the other ranks
wait in a barrier before loading it, and each rank saves its own shard under a
name with its rank in it. Lint only.
"""

import io
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    master_process = rank == 0
    model = DDP(nn.Linear(8, 2))
    model(torch.randn(4, 8)).sum().backward()
    if master_process:
        torch.save(model.module.state_dict(), "last.pt")
    dist.barrier()
    model.module.load_state_dict(torch.load("last.pt", map_location="cpu"))
    shard = f"optimizer_rank{rank}.pt"
    torch.save({"step": 1}, shard)
    torch.save({"step": 1}, os.path.join("shards", f"{dist.get_rank()}.pt"))
    buffer = io.BytesIO()
    torch.save(model.module.state_dict(), buffer)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
