"""Takes the local rank from --local-rank (default 0); torchrun passes no flag."""

import argparse

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    grad = torch.ones(1024, device="cuda")
    dist.all_reduce(grad)
    print(f"rank {dist.get_rank()} sum {grad[0].item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
