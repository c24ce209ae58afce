"""An older training script that takes --local_rank, started with torch.distributed.launch."""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    parser = argparse.ArgumentParser(description="ResNet-ish training")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=2)
    return parser.parse_args()


def main():
    args = get_args()
    dist.init_process_group(backend="gloo", init_method="env://")
    model = DDP(nn.Conv2d(3, 8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for _ in range(args.epochs):
        opt.zero_grad()
        model(torch.randn(2, 3, 16, 16)).mean().backward()
        opt.step()


if __name__ == "__main__":
    main()
