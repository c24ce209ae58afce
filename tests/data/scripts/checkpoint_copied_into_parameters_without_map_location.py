"""Every rank resumes from one consolidated checkpoint (saved from cuda:0)
without map_location and copies its slice of each weight into the parameters
through a helper: each rank first puts the whole checkpoint on cuda:0."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def copy_into(model, full):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(full[name])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = torch.nn.Linear(1024, 1024).cuda()
    if os.path.exists("consolidated.pt"):
        checkpoint = torch.load("consolidated.pt")  # expect: checkpoint-map-location
        copy_into(model, checkpoint["model"])
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
