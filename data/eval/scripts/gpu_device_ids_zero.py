"""Single-GPU code made "distributed": the model goes to cuda:0 with device_ids=[0]."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group(backend="nccl")
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to("cuda:0")
    model = DDP(model, device_ids=[0])
    out = model(torch.randn(32, 512, device="cuda:0"))
    out.sum().backward()


if __name__ == "__main__":
    main()
