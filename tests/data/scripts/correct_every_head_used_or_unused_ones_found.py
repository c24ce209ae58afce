"""Task heads and an auxiliary decoder under DDP, done right: every head runs
each step, and the model whose decoder is switched off tells DDP to look
for unused parameters; a flag only ever set to True keeps its branch in use."""

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

    def forward(self, x):
        h = self.trunk(x)
        return {task: self.heads[task](h) for task in TASKS}


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 32)
        self.classifier = nn.Linear(32, 4)
        self.decoder = nn.Linear(32, 16)
        self.use_aux = False

    def forward(self, x):
        h = self.encoder(x)
        out = self.classifier(h)
        if self.use_aux:
            out = out + self.decoder(h).mean()
        return out


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    multi = DDP(MultiTask().cuda(local_rank), device_ids=[local_rank])
    always = WithAux()
    always.use_aux = True
    steady = DDP(always.cuda(local_rank), device_ids=[local_rank])
    aux = DDP(WithAux().cuda(local_rank), device_ids=[local_rank], find_unused_parameters=True)
    for step in range(100):
        x = torch.randn(8, 16, device=f"cuda:{local_rank}")
        sum(out.sum() for out in multi(x).values()).backward()
        steady(x).sum().backward()
        aux.module.use_aux = step < 10
        aux(x).sum().backward()
    del multi, steady, aux  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
