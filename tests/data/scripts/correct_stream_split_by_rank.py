"""Streams split between the ranks: datasets' split_dataset_by_node, and an
IterableDataset that skips by rank in __iter__; an evaluation stream read in
full by rank 0 only."""

import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


class Numbers(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        for i in range(rank, self.n, world):
            yield torch.tensor([float(i)])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(nn.Linear(1, 1).cuda(), device_ids=[local_rank])
    web = load_dataset("some/corpus", split="train", streaming=True).shuffle(buffer_size=1000)
    web = split_dataset_by_node(web, rank=rank, world_size=world)
    web_loader = DataLoader(web.with_format("torch"), batch_size=8)
    numbers = DataLoader(Numbers(10_000), batch_size=8)
    for batch in numbers:
        model(batch.cuda()).sum().backward()
    for batch in web_loader:
        model(batch["x"].cuda()).sum().backward()
    if rank == 0:
        held_out = load_dataset("some/corpus", split="validation", streaming=True)
        for batch in DataLoader(held_out.with_format("torch"), batch_size=8):
            print(model.module(batch["x"].cuda()).mean())
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
