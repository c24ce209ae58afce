"""Hard examples shared across ranks, but only by the ranks that found enough.

Each rank tests its own batch's loss: the ranks above the threshold enter
all_gather, the others go on to the next step's gradient all-reduce, and the
two groups wait for each other.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def share_hard_examples(losses, inputs, threshold):
    if losses.mean() > threshold:
        hard = inputs[losses.topk(4).indices]
        bucket = [torch.empty_like(hard) for _ in range(dist.get_world_size())]
        dist.all_gather(bucket, hard)  # expect: collective-mismatch
        return torch.cat(bucket)
    return None


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = DDP(nn.Linear(8, 1).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(100):
        inputs = torch.randn(32, 8, device="cuda")
        losses = model(inputs).pow(2).squeeze(1)
        optimizer.zero_grad()
        losses.mean().backward()
        optimizer.step()
        share_hard_examples(losses.detach(), inputs, 1.0)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
