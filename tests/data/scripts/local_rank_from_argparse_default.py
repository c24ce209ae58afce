import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument(  # expect: local-rank-not-from-env
        "--local-rank",
        "--local_rank",
        type=int,
        default=0,
    )
    p.add_argument("--epochs", type=int, default=10)
    return p.parse_args()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    model = nn.Linear(128, 10).cuda(args.local_rank)
    model = DDP(model, device_ids=[args.local_rank])
    for _ in range(args.epochs):
        model(torch.randn(8, 128, device=f"cuda:{args.local_rank}")).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
