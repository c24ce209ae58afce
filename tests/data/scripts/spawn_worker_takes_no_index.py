"""Two ways to misread what mp.spawn passes its worker.

The training worker was written for torchrun (`def run(args)`), so spawn's
run(i, args) gives it one argument too many ("run() takes 1 positional
argument but 2 were given"); the evaluation path calls the worker instead of
passing it, so it runs in the parent, where it waits at init_process_group for
a rank that never comes, and spawn would be handed None.

python spawn_worker_takes_no_index.py [--eval]
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def run(args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29532")
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def evaluate(index, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=index, world_size=world_size)
    model = DDP(nn.Linear(16, 2))
    with torch.no_grad():
        print(model(torch.randn(4, 16)).argmax(1))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--eval", action="store_true")
    args = parser.parse_args()
    if args.eval:
        mp.spawn(evaluate(0, args.gpus), nprocs=args.gpus)  # expect: mp-spawn-arguments
    else:
        mp.spawn(run, args=(args,), nprocs=args.gpus)  # expect: mp-spawn-arguments


if __name__ == "__main__":
    main()
