"""A normal torchrun script, launched with CUDA_VISIBLE_DEVICES set to nothing."""

import os

import torch
import torch.distributed as dist


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    print(torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
