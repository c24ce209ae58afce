"""The fix of sync_batchnorm_on_the_cpu_under_gloo.py: plain BatchNorm on the CPU
(no finding expected).

Runs under torchrun: each rank normalises its own batch.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Conv1d(1, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten())
    model = DDP(model)
    for _ in range(2):
        model(torch.randn(4, 1, 16)).sum().backward()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
