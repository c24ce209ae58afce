"""Multi-task training that runs one task head per step, and an auxiliary
decoder switched off after warm-up: under a DDP built without
find_unused_parameters the heads and the decoder left out get no gradient."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TASKS = ("segment", "depth")


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.heads = nn.ModuleDict({task: nn.Linear(32, 4) for task in TASKS})

    def forward(self, x, task):
        return self.heads[task](self.trunk(x))  # expect: unused-parameters


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 32)
        self.classifier = nn.Linear(32, 4)
        self.decoder = nn.Linear(32, 16)
        self.use_aux = True

    def forward(self, x):
        h = self.encoder(x)
        out = self.classifier(h)
        if self.training and self.use_aux:
            out = out + self.decoder(h).mean()
        return out


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    multi = DDP(MultiTask().cuda(local_rank), device_ids=[local_rank])
    aux = DDP(WithAux().cuda(local_rank), device_ids=[local_rank])
    for step in range(100):
        x = torch.randn(8, 16, device=f"cuda:{local_rank}")
        multi(x, TASKS[step % len(TASKS)]).sum().backward()
        aux.module.use_aux = step < 10  # expect: unused-parameters
        aux(x).sum().backward()
    del multi, aux  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
