"""A correct, modern DDP script for torchrun on GPUs (no finding expected).

torchrun --nproc_per_node=4 correct_torchrun_nccl.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_loader(batch_size: int) -> tuple[DataLoader, DistributedSampler]:
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 10, (1024,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=2)
    return loader, sampler


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", local_rank)

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    loader, sampler = build_loader(batch_size=32)

    for epoch in range(3):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs = inputs.cuda(non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(ddp_model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        total = torch.tensor([loss.item()], device=device)
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: mean loss {total.item() / dist.get_world_size():.4f}")
            torch.save(ddp_model.module.state_dict(), "checkpoint.pt")
        dist.barrier()

    del ddp_model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
