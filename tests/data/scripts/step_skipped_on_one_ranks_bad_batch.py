"""A rank that meets a NaN loss or an empty batch skips the step on its own:
the other ranks wait for it in DDP's gradient all-reduce (in backward)."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def train_step(model, optimizer, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(8, 1).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    for step, (x, y) in enumerate(loader):
        x, y = x.cuda(local_rank), y.cuda(local_rank)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
            if not torch.isfinite(loss):  # expect: uneven-inputs
                print(f"step {step}: non-finite loss, skipped")
                continue
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for x, y in loader:
        if len(x) == 0:  # expect: uneven-inputs
            continue
        train_step(model, optimizer, x.cuda(local_rank), y.cuda(local_rank))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
