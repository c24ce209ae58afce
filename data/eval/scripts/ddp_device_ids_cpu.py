"""Passes device_ids to DDP although the model stays on the CPU (gloo)."""

import os

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    print(ddp_model)


if __name__ == "__main__":
    main()
