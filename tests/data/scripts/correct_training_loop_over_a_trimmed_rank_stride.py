"""Token-bucketed translation batches, shuffled alike on every rank, trimmed to
a multiple of the world size, then dealt out with batches[rank::world]: every
rank takes the same number of steps (fairseq pads with dummy batches instead)."""

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
    batches = batches[: len(batches) // world_size * world_size]
    my_batches = batches[rank::world_size]
    for step, batch in enumerate(my_batches):
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
