"""GPU augmentation under torchrun whose normalisation constants are made on the CPU
at import time and moved to each batch's device where they are used:

    torchrun --nproc_per_node=4 train.py

Every rank normalises on its own GPU. Needs GPUs: linted here, not run.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255.0
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255.0


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() - MEAN.to(images.device)) / STD.to(images.device)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    model = DDP(nn.Conv2d(3, 8, 3).to(device), device_ids=[local_rank])
    images = torch.randint(0, 256, (4, 3, 32, 32), device=device)
    model(normalise(images)).mean().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
