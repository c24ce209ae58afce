"""A collective under a test on a value every rank agreed on first (no finding expected).

The mean loss is all-reduced before the test, so every rank takes the same
branch; a rank-0 flag broadcast first works the same way.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def share_hard_examples(losses, inputs, threshold):
    mean = losses.mean()
    dist.all_reduce(mean)
    if mean > threshold * dist.get_world_size():
        hard = inputs[losses.topk(4).indices]
        bucket = [torch.empty_like(hard) for _ in range(dist.get_world_size())]
        dist.all_gather(bucket, hard)
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
