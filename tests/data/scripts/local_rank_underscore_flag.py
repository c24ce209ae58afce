import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument(  # expect: local-rank-arg-mismatch
    "--local_rank",
    type=int,
    default=int(os.environ.get("LOCAL_RANK", "0")),
)
args = parser.parse_args()


def main():
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    model = DDP(nn.Linear(4, 4).cuda(args.local_rank), device_ids=[args.local_rank])
    model(torch.ones(1, 4).cuda(args.local_rank)).sum().backward()


if __name__ == "__main__":
    main()
