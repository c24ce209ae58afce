"""An iterable dataset that deals whole shards out by rank and yields every
sample of each: the two shards hold 24 and 8 samples, so rank 1 runs out of
batches after 2 steps and leaves the loop while rank 0, with 6 batches, waits
in DDP's gradient all-reduce for a rank that never comes."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

SAMPLES_PER_SHARD = (24, 8)


class ShardStream(IterableDataset):
    def __init__(self, shards, rank, world):
        self.shards, self.rank, self.world = shards, rank, world

    def __iter__(self):
        for shard in self.shards[self.rank :: self.world]:  # expect: uneven-inputs
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
    print(f"rank {int(os.environ['RANK'])}: trained {steps} steps", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
