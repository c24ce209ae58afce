"""mp.spawn handed its arguments the ways that fit the worker (no finding expected).

A one-element tuple with its comma, a worker with a default and one taking
*rest, a partial that fixes a keyword, a factory that returns the worker
and a callable object,
start_processes with args by position, a tuple built beforehand and
passed in parentheses, and values named like the worker's parameters, each in
its own place (a field `cfg.lr` lands in lr), and a worker whose annotations
(`world_size: int, cfg: Config`) the values match in kind, and the process
count handed to a worker's count parameter (`ngpus_per_node`), not its index.
"""

import functools
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(index, world_size, port):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=index, world_size=world_size)


def train(index, world_size, lr=0.1):
    setup(index, world_size, 29541)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def probe(index, *shapes):
    print(index, shapes)


def make_worker(world_size):
    return functools.partial(train, world_size=world_size)


class Worker:
    def __init__(self, world_size):
        self.world_size = world_size

    def __call__(self, index):
        train(index, self.world_size)


class Config:
    world_size = 2
    lr = 0.05


def configured(index, world_size: int, cfg: Config):
    train(index, world_size, cfg.lr)


def per_gpu(gpu, ngpus_per_node, cfg):
    train(gpu, ngpus_per_node, cfg.lr)


def main():
    world_size = 2
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)
    mp.spawn(train, args=(world_size, 0.01), nprocs=world_size, join=True)
    mp.spawn(probe, args=(1, 2, 3), nprocs=world_size)
    mp.spawn(functools.partial(train, lr=0.05), args=(world_size,), nprocs=world_size)
    mp.spawn(make_worker(world_size), nprocs=world_size)
    mp.spawn(Worker(world_size), nprocs=world_size)
    mp.start_processes(train, (world_size,), world_size, start_method="spawn")
    settings = (world_size, 0.2)
    mp.spawn(train, args=(settings), nprocs=world_size)
    cfg = Config()
    mp.spawn(train, args=(world_size, cfg.lr), nprocs=world_size)
    mp.spawn(train, args=(cfg.world_size, cfg.lr), nprocs=world_size)
    gpus = torch.cuda.device_count()
    mp.spawn(configured, args=(gpus, cfg), nprocs=world_size)
    mp.spawn(configured, args=(len(cfg.lr_steps), Config()), nprocs=world_size)
    mp.spawn(per_gpu, args=(world_size, cfg), nprocs=world_size)


if __name__ == "__main__":
    main()
