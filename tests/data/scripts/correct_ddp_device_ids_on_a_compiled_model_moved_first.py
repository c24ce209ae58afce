"""DDP(device_ids=[local_rank]) over a compiled model: torch.compile wraps the
module where it already is, and it was moved to the rank's GPU before (also when
compiling is an option and the other branch is the moved model itself)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)

    encoder = torch.nn.Linear(16, 16)
    encoder = encoder.to(device, memory_format=torch.channels_last)
    compiled = torch.compile(encoder)
    encoder_ddp = DDP(compiled, device_ids=[local_rank])

    raw_head = torch.nn.Linear(16, 4).to(device)
    head = torch.compile(raw_head) if args.compile else raw_head
    head = DDP(head, device_ids=[local_rank])

    x = torch.randn(8, 16, device=device)
    head(encoder_ddp(x)).sum().backward()
    del encoder_ddp, head  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
