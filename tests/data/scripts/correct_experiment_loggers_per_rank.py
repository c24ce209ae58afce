"""Experiment loggers the ways wandb and TensorBoard document for DDP (no finding expected).

wandb on rank 0 only (init and log), one wandb run per rank joined by
group=, a mode chosen per rank, a SummaryWriter on rank 0 only through a
conditional expression, and a writer folder per rank.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def train(model, optimizer, rank, writer):
    for step in range(100):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            wandb.log({"loss": loss.item()}, step=step)
        if writer is not None:
            writer.add_scalar("loss", loss.item(), step)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if rank == 0:
        wandb.init(project="demo")
    wandb.init(project="demo", group="ddp-run", name=f"rank-{rank}", reinit=True)
    wandb.init(project="demo", mode="online" if rank == 0 else "disabled", reinit=True)
    writer = SummaryWriter("runs/demo") if rank == 0 else None
    per_rank = SummaryWriter(f"runs/demo/rank{rank}")
    model = DDP(nn.Linear(8, 1).cuda(), device_ids=[local_rank])
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, writer)
    per_rank.close()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
