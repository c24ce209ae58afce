"""The tutorial's setup() copied onto two computers: one copy runs on each PC,
each given its rank by hand, and both look for the store at localhost. On its
own machine rank 0 listens; rank 1, on the other PC, looks for a store on
itself, and init_process_group waits until it times out.

Run one copy on each PC:
    first PC:   python train.py --rank 0 --world-size 2
    second PC:  python train.py --rank 1 --world-size 2

Linted only: the mistake needs two machines (over 127.0.0.1 both copies meet).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"  # expect: master-endpoint-mismatch
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    setup(args.rank, args.world_size)
    model = DDP(torch.nn.Linear(8, 2))
    model(torch.randn(4, 8)).sum().backward()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
