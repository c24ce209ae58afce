"""The twin of shards_dealt_by_rank_then_expanded.py: the same shards of 24 and
8 samples dealt out by rank, but each rank cycles its stream and every rank
trains the same fixed number of steps, so they finish together."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

SAMPLES_PER_SHARD = (24, 8)
STEPS = 3


class ShardStream(IterableDataset):
    def __init__(self, shards, rank, world):
        self.shards, self.rank, self.world = shards, rank, world

    def __iter__(self):
        while True:  # an endless stream: the training loop decides the epoch's length
            for shard in self.shards[self.rank :: self.world]:
                for i in range(len(shard)):
                    yield torch.tensor([float(shard[i])]), torch.tensor(float(shard[i] % 2))


def main():
    dist.init_process_group("gloo")
    shards = [list(range(count)) for count in SAMPLES_PER_SHARD]
    loader = DataLoader(ShardStream(shards, dist.get_rank(), dist.get_world_size()), batch_size=4)
    torch.manual_seed(0)
    model = DDP(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for x, y in loader:
        loss = (model(x).squeeze(1) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if steps == STEPS:
            break
    print(f"rank {int(os.environ['RANK'])}: trained {steps} steps", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
