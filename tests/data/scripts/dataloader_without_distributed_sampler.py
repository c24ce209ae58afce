"""Every rank trains (and validates) on the whole dataset: the loaders have no
DistributedSampler, so two ranks do twice the work of one and gain nothing.

torchrun --nproc_per_node=2 dataloader_without_distributed_sampler.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    train_set = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    val_set = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(train_set, 16, shuffle=True)  # expect: missing-distributed-sampler
    val_loader = DataLoader(val_set, batch_size=32)  # expect: missing-distributed-sampler
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(2):
        for step, (inputs, targets) in enumerate(loader):
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"[rank {local_rank}] epoch {epoch}: {step + 1} steps", flush=True)
        with torch.no_grad():
            val_loss = sum(nn.functional.mse_loss(model(x), y) for x, y in val_loader)
        print(f"[rank {local_rank}] val loss {val_loss.item():.3f}", flush=True)

    if dist.get_rank() == 0:
        # Rank 0 alone writes a report over the whole set: that loader needs no sampler.
        report_loader = DataLoader(val_set, batch_size=64)
        with torch.no_grad():
            for inputs, _targets in report_loader:
                print(model.module(inputs).mean().item())
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
