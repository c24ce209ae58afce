"""Batches grouped over a DistributedSampler: each rank draws its own half of
the dataset, and the batch sampler groups those indices.

Runs under torchrun: each rank prints how many samples it saw (8 of 16).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    batches = BatchSampler(DistributedSampler(dataset), batch_size=4, drop_last=True)
    loader = DataLoader(dataset, batch_sampler=batches)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = 0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += len(x)
    print(f"rank {rank} saw {seen} samples", flush=True)
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
