"""The usual GPU recipe: nccl backend and set_device after init."""

import os

import torch
import torch.distributed as dist


def main():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    print(f"rank {dist.get_rank()} on cuda:{local_rank}")


if __name__ == "__main__":
    main()
