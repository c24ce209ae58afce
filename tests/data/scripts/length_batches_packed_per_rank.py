"""A speech-style trainer whose batch sampler shards the utterances by rank and
then packs each rank's share up to a frame budget on its own: rank 0's short
utterances go two to a batch (three batches), rank 1's long ones one to a
batch (six). Rank 0 finishes its epoch and waits at the barrier while rank 1
waits in DDP's gradient all-reduce for a fourth step nobody else takes. Runs
on CPU ranks (gloo); the short timeout turns the hang into an error."""

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
        shard = list(range(len(self.frames)))[self.rank :: self.world]  # expect: uneven-inputs
        batch, total = [], 0
        for index in shard:
            if batch and total + self.frames[index] > self.max_frames:
                yield batch
                batch, total = [], 0
            batch.append(index)
            total += self.frames[index]
        if batch:
            yield batch


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
