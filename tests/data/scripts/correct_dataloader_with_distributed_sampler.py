"""The fix of dataloader_without_distributed_sampler.py and
sampler_set_epoch_never_called.py (no finding expected): each rank reads its
own shard, the sampler learns the epoch, validation is sharded without
shuffling, and the loader only rank 0 reads has no sampler.

torchrun --nproc_per_node=2 correct_dataloader_with_distributed_sampler.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    train_set = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    val_set = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=16, sampler=train_sampler)
    val_loader = DataLoader(
        val_set, batch_size=32, sampler=DistributedSampler(val_set, shuffle=False)
    )
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(2):
        train_sampler.set_epoch(epoch)
        for step, (inputs, targets) in enumerate(train_loader):
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"[rank {local_rank}] epoch {epoch}: {step + 1} steps", flush=True)
        with torch.no_grad():
            total = torch.zeros(2)
            for x, y in val_loader:
                total += torch.tensor(
                    [nn.functional.mse_loss(model(x), y, reduction="sum"), len(x)]
                )
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"val loss {total[0].item() / total[1].item():.3f}", flush=True)

    if dist.get_rank() == 0:
        report_loader = DataLoader(val_set, batch_size=64)
        with torch.no_grad():
            for inputs, _targets in report_loader:
                print(model.module(inputs).mean().item())
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
