"""Two ranks per node on a machine with one GPU: rank 1 asks for cuda:1."""

import os

import torch
import torch.distributed as dist


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    tensor = torch.ones(4, device="cuda")
    dist.all_reduce(tensor)
    print(f"rank {dist.get_rank()}: {tensor.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
