"""Requires --local_rank on the command line; started with torchrun, which passes none."""

import argparse

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--batch-size", type=int, default=64)
args = parser.parse_args()

dist.init_process_group("gloo")
print(f"local rank {args.local_rank} of {dist.get_world_size()}")
dist.destroy_process_group()
