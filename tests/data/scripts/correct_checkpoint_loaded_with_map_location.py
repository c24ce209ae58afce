"""Checkpoints loaded the ways that keep each rank on its own GPU.

map_location to the CPU or the rank's device, ImageNet's branch that loads
without it only where no GPU was chosen, a rank-0-only evaluation load, and a
tensor that is data, not a model's state. Lint only.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def resume(model, path, gpu):
    if gpu is None:
        checkpoint = torch.load(path)
    else:
        checkpoint = torch.load(path, map_location=f"cuda:{gpu}")
    model.load_state_dict(checkpoint["model"])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = nn.Linear(8, 2).cuda(local_rank)
    model.load_state_dict(torch.load("init.pt", map_location="cpu"))
    resume(model, "last.pt", local_rank)
    word_freq = torch.load("word_freq.pt")
    print(word_freq.sum())
    model = DDP(model, device_ids=[local_rank])
    if dist.get_rank() == 0:
        best = torch.load("best.pt")
        model.module.load_state_dict(best)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
