"""A config whose device defaults to cuda:0 for single-GPU runs and is set to
the rank's own GPU once the launch is known: every rank ends up on its own."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class Config:
    lr: float = 3e-4
    device: str = "cuda:0"


def main():
    cfg = Config()
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        cfg.device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
    model = nn.Linear(32, 2).to(torch.device(cfg.device))
    if dist.is_initialized():
        model = DDP(model, device_ids=[torch.device(cfg.device).index])
    print(model(torch.randn(4, 32, device=cfg.device)).sum().item())


if __name__ == "__main__":
    main()
