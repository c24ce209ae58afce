"""Each rank reads whole files; the files differ in size, so the ranks' batch counts differ."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

FILE_SIZES = [40, 56, 64, 30, 90]  # samples per file on disk


def load_my_files(rank, world):
    samples = [torch.randn(n, 6) for n in FILE_SIZES[rank::world]]
    return torch.cat(samples).split(16)


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, batch in enumerate(load_my_files(rank, world)):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()
    print(f"rank {rank} done after {i + 1} batches")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
