"""mp.spawn with args in another order than the worker's parameters.

spawn calls train_worker(i, *args): the config path lands in world_size and
the world size in config_path, so init_process_group gets a string; and
evaluate_worker(cfg, rank) gets the process index as its cfg; and
sample_worker(ngpus_per_node, gpu, opt) gets the process count, nprocs, as
every process's gpu.
"""

import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP


def train_worker(rank, world_size, config_path):
    with open(config_path) as handle:
        cfg = yaml.safe_load(handle)
    dist.init_process_group("nccl", init_method=cfg["url"], rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = DDP(nn.Linear(8, 2).cuda(rank), device_ids=[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    for _ in range(cfg["steps"]):
        optimizer.zero_grad()
        model(torch.randn(4, 8, device=rank)).sum().backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def evaluate_worker(cfg, rank):
    dist.init_process_group("nccl", init_method=cfg["url"], rank=rank, world_size=cfg["world"])
    torch.cuda.set_device(rank)
    dist.destroy_process_group()


def sample_worker(ngpus_per_node, gpu, opt):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=opt.url, rank=gpu, world_size=ngpus_per_node)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="config.yaml")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--url", default="tcp://127.0.0.1:29501")
    args = parser.parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(train_worker, args=(args.config, world_size), nprocs=world_size)  # expect: mp-spawn-arguments
    cfg = {"url": "tcp://127.0.0.1:29500", "world": world_size}
    mp.spawn(evaluate_worker, args=(cfg,), nprocs=world_size)  # expect: mp-spawn-arguments
    ngpus = args.gpus
    mp.spawn(sample_worker, nprocs=ngpus, args=(ngpus, args))  # expect: mp-spawn-arguments


if __name__ == "__main__":
    main()
