"""DDP is given a model this file does not build on the CPU.

A factory imported from the project (detectron2's build_model(cfg) is one)
moves the model to the configured device itself, and a trainer class wraps
the model its caller already moved. Neither is a CPU module as far as this
file shows, so device_ids is not reported. Lint only.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from project.modeling import build_model


class Trainer:
    def __init__(self, model, local_rank: int):
        self.model = model
        self.ddp_model = DDP(self.model, device_ids=[local_rank])

    def step(self, batch):
        loss = self.ddp_model(batch).sum()
        loss.backward()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = build_model({"device": f"cuda:{local_rank}"})
    model = DDP(model, device_ids=[local_rank])
    Trainer(model.module, local_rank).step(torch.randn(8, 16, device="cuda"))


if __name__ == "__main__":
    main()
