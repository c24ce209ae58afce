"""A feature projector that forward runs only when asked for features, asked
every few steps (and at random) under a DDP that expects every parameter."""

import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.proj = nn.Linear(8, 16)
        self.aux = nn.Linear(8, 2)

    def forward(self, x, return_feat=False, with_aux=False):
        f = self.body(x)
        out = self.head(f)
        if with_aux:
            out = out + self.aux(f)
        if return_feat:
            return out, self.proj(f)
        return out, None


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(Student().cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        x = torch.randn(4, 8, device="cuda")
        use_feat = step % 4 == 0  # expect: unused-parameters
        out, feat = model(x, return_feat=use_feat, with_aux=random.random() < 0.5)  # expect: unused-parameters
        loss = out.sum()
        if use_feat:
            loss = loss + feat.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
