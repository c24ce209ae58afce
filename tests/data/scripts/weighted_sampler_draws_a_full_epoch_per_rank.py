"""Class-balanced training under DDP with torch's WeightedRandomSampler, which
draws num_samples indices from the whole dataset on every rank.

Each rank runs a full epoch of its own: N ranks do N times the work (and with
one seed on every rank, the same batches). Each rank prints how many of the
128 samples it drew.
torchrun --nproc_per_node=2 weighted_sampler_draws_a_full_epoch_per_rank.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler


def main() -> None:
    dist.init_process_group("gloo")
    labels = torch.tensor([0] * 96 + [1] * 32)
    data = TensorDataset(torch.arange(128, dtype=torch.float32).unsqueeze(1), labels)
    weights = (1.0 / torch.bincount(labels).float())[labels]
    sampler = WeightedRandomSampler(weights, num_samples=len(data), replacement=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)  # expect: missing-distributed-sampler
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    drawn = 0
    for inputs, _ in loader:
        drawn += len(inputs)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"[rank {dist.get_rank()}] drew {drawn} of 128", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
