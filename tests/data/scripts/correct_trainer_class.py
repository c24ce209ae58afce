"""A correct class-based trainer: device first, collectives on every rank."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.model = DDP(nn.Linear(8, 8).to(self.local_rank), device_ids=[self.local_rank])

    def train(self):
        loss = self.model(torch.zeros(4, 8, device=self.local_rank)).sum()
        loss.backward()
        self.save()

    def save(self):
        if self.rank == 0:
            torch.save(self.model.state_dict(), "model.pt")
        dist.barrier()  # every rank waits for the checkpoint


def main():
    trainer = Trainer()
    trainer.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
