"""DDP given device_ids while the model's parameters are still on the CPU."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = torch.nn.Linear(64, 8)  # .cuda() forgotten
    model = DDP(model, device_ids=[local_rank])
    print(f"rank {dist.get_rank()}: wrapped", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
