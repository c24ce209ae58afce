"""Moves the model with .cuda() (no index) on a machine whose torch has no CUDA."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    model = nn.Linear(100, 10).cuda()
    model = DDP(model)
    out = model(torch.randn(2, 100).cuda())
    print(out.shape)


if __name__ == "__main__":
    main()
