"""Class-balanced training under DDP where each rank draws its share: the
WeightedRandomSampler draws num_samples // world_size indices from a generator
seeded with the rank, so the ranks together draw one epoch of other samples.

Each rank prints how many of the 128 samples it drew.
torchrun --nproc_per_node=2 correct_weighted_sampler_per_rank_share.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    labels = torch.tensor([0] * 96 + [1] * 32)
    data = TensorDataset(torch.arange(128, dtype=torch.float32).unsqueeze(1), labels)
    weights = (1.0 / torch.bincount(labels).float())[labels]
    generator = torch.Generator().manual_seed(rank)  # another draw on every rank
    sampler = WeightedRandomSampler(
        weights, num_samples=len(data) // world_size, replacement=True, generator=generator
    )
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    drawn = 0
    for inputs, _ in loader:
        drawn += len(inputs)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"[rank {rank}] drew {drawn} of 128", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
