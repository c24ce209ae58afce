"""A class-based trainer: its methods are traced like functions.

The shape of many real trainers (nanoGPT-style Trainer classes, sparsify's
save()): the process group is set up in __init__, work happens in methods
called through self.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self):
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        dist.barrier()  # on cuda:0 in every rank
        torch.cuda.set_device(self.local_rank)  # expect: set-device-order
        self.model = DDP(nn.Linear(8, 8).to(self.local_rank), device_ids=[self.local_rank])

    def train(self):
        loss = self.model(torch.zeros(4, 8, device=self.local_rank)).sum()
        loss.backward()
        self.save()

    def save(self):
        if self.rank == 0:
            torch.save(self.model.state_dict(), "model.pt")
            dist.barrier()  # expect: collective-mismatch


def main():
    trainer = Trainer()
    trainer.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
