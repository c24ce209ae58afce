"""Counts correct predictions in a CPU tensor and all_reduces it on the nccl backend."""

import os

import torch
import torch.distributed as dist


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    correct = torch.tensor([87, 100])
    dist.all_reduce(correct, op=dist.ReduceOp.SUM)
    print(f"accuracy {correct[0].item() / correct[1].item():.2%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
