"""Broadcasts initial weights from rank 0; the tensor is created without a device."""

import os

import torch
import torch.distributed as dist


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    weights = torch.zeros(10)
    dist.broadcast(weights, src=0)


if __name__ == "__main__":
    main()
