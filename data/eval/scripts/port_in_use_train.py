"""A working DDP script; the rendezvous port is held by another process when launched."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(12, 1))
    loss = model(torch.randn(5, 12)).pow(2).mean()
    loss.backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
