"""wandb.init on rank 0 only, wandb.log on every rank: the others raise."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


def train(model, optimizer, steps):
    for step in range(steps):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        wandb.log({"loss": loss.item()}, step=step)  # expect: experiment-logger-ddp


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if dist.get_rank() == 0:
        wandb.init(project="demo")
    model = DDP(nn.Linear(8, 1).cuda(), device_ids=[local_rank])
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 100)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
