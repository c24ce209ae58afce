"""mp.spawn with args in another order than the worker's annotated parameters.

spawn calls train_worker(i, *args): the config object lands in world_size
(annotated int) and the GPU count in cfg (annotated TrainConfig), so
init_process_group gets a config for its world size. No value is named like
a parameter: only the annotations and how each value is built tell.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class TrainConfig:
    lr: float = 0.1
    steps: int = 10
    port: int = 29512


def train_worker(rank: int, world_size: int, cfg: TrainConfig):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = DDP(nn.Linear(8, 2).cuda(rank), device_ids=[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8, device=rank)).sum().backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def main():
    config = TrainConfig(lr=0.05)
    n_gpus = torch.cuda.device_count()
    mp.spawn(train_worker, args=(config, n_gpus), nprocs=n_gpus, join=True)  # expect: mp-spawn-arguments


if __name__ == "__main__":
    main()
