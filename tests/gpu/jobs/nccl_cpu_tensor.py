"""NCCL asked to reduce a tensor that still lives on the CPU."""

import os

import torch
import torch.distributed as dist


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    correct = torch.tensor([3.0, 4.0])  # never moved to the GPU
    dist.all_reduce(correct)
    print(f"rank {dist.get_rank()}: {correct.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
