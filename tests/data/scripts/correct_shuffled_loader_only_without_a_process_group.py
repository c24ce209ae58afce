"""One script for a single GPU and for torchrun: the shuffled loader without a
sampler is the single-process one; under torchrun the sampler shuffles."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    distributed = "LOCAL_RANK" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    model = nn.Linear(8, 1).cuda(local_rank)
    if distributed:
        dist.init_process_group("nccl")
        sampler = DistributedSampler(data)
        loader = DataLoader(data, batch_size=32, sampler=sampler)
        model = DDP(model, device_ids=[local_rank])
    else:
        sampler = None
        loader = DataLoader(data, batch_size=32, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.cuda(local_rank)), y.cuda(local_rank))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
