"""A script that picks an Intel GPU (xpu) when there is one, with the process group
hard-coded to NCCL (nccl-not-available).

On an xpu node PyTorch has no NCCL: init_process_group fails with "Distributed
package doesn't have NCCL built in"; the backend must follow the device (xccl).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    torch.xpu.set_device(local_rank)
    return torch.device("xpu", local_rank)


def main() -> None:
    device = pick_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")  # expect: nccl-not-available
    model = DDP(nn.Linear(8, 1).to(device))
    model(torch.randn(2, 8, device=device)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
