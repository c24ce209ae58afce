"""Each rank saves its own shard of a ZeRO-style optimizer and loads the file of its
rank number on resuming, under an elastic launch that may come back with fewer
nodes:

    torchrun --nnodes=1:4 --nproc_per_node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HOST:29400 train.py

Runs under torchrun, twice: with two ranks it saves two shards; the restart with
one rank loads shard 0 into a partition that now holds every parameter, and
fails ("doesn't match the size of optimizer's group").
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)))
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
    )
    shard = f"optim_shard_rank{rank}.pt"
    if os.path.exists(shard):
        optimizer.optim.load_state_dict(torch.load(shard, map_location="cpu"))  # expect: resume-different-world-size
        print("resumed", flush=True)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    torch.save(optimizer.optim.state_dict(), shard)
    print("saved", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
