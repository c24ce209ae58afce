"""Token-bucketed translation batches, shuffled alike on every rank and dealt
out with batches[rank::world]: 7 batches on 2 ranks give rank 0 four steps
and rank 1 three, so rank 0's last gradient all-reduce finds nobody."""

import datetime
import os
import random

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def token_buckets(lengths, max_tokens):
    batches, batch, longest = [], [], 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        longest = max(longest, lengths[index])
        if batch and longest * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch, longest = [], lengths[index]
        batch.append(index)
    return batches + [batch] if batch else batches


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DDP(torch.nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lengths = [8] * 28  # 7 batches of 4 sentences
    batches = token_buckets(lengths, max_tokens=32)
    random.Random(0).shuffle(batches)
    my_batches = batches[rank::world_size]
    for step, batch in enumerate(my_batches):  # expect: uneven-inputs
        loss = model(torch.randn(len(batch), 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {rank} trained {len(my_batches)} steps", flush=True)
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
