"""A label outside the classifier's range reaches cross_entropy on the GPU: a device-side assert."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_CLASSES = 10


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(32, NUM_CLASSES).cuda(), device_ids=[local_rank])
    inputs = torch.randn(16, 32, device="cuda")
    labels = torch.arange(16, device="cuda")  # labels 10..15 have no class
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
    print(f"rank {dist.get_rank()}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
