"""The trainer of length_batches_packed_per_rank.py with the sampler's fix:
batches are packed over all utterances, padded to a multiple of the world
size, and only then shared out (batches[rank::world]), so every rank takes
the same number of steps."""

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

# frames per utterance: the even ones (rank 0's) short, the odd ones (rank 1's) long
FRAMES = [10, 30, 10, 30, 10, 30, 10, 30, 10, 30, 10, 30]


class Utterances(Dataset):
    def __len__(self):
        return len(FRAMES)

    def __getitem__(self, index):
        return torch.randn(FRAMES[index], 4).mean(0), torch.randn(1)


class FrameBudgetSampler(Sampler):
    def __init__(self, frames, max_frames, rank, world):
        self.frames, self.max_frames = frames, max_frames
        self.rank, self.world = rank, world

    def __iter__(self):
        batches, batch, total = [], [], 0
        for index in range(len(self.frames)):
            if batch and total + self.frames[index] > self.max_frames:
                batches.append(batch)
                batch, total = [], 0
            batch.append(index)
            total += self.frames[index]
        if batch:
            batches.append(batch)
        batches += batches[: (self.world - len(batches) % self.world) % self.world]
        return iter(batches[self.rank :: self.world])


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Utterances(), batch_sampler=FrameBudgetSampler(FRAMES, 25, rank, world))
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    dist.barrier()
    print(f"trained rank {rank} in {steps} steps")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
