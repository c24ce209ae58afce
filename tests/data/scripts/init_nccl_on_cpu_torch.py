"""A training start that asks for NCCL; on a CPU-only torch build init fails.

Recorded with: torchrun --nproc-per-node 2 init_nccl_on_cpu_torch.py
(log: tests/data/logs/nccl_on_cpu_only_torch.txt)
"""

import os

import torch
import torch.distributed as dist


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")  # expect: set-device-order
    model = torch.nn.Linear(4, 4).to(f"cuda:{local_rank}")
    print(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
