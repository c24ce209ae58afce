"""Detection-style training whose batches are grouped by aspect ratio: the batch
sampler groups the indices of a RandomSampler, as torchvision's detection
reference does when it runs on one GPU. Under DDP every rank then draws from
the whole dataset: two ranks each train on all 16 samples per epoch.

Runs under torchrun: each rank prints how many samples it saw (16 of 16).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    batches = BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=True)
    loader = DataLoader(dataset, batch_sampler=batches)  # expect: missing-distributed-sampler
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
