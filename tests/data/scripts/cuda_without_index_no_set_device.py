import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend="nccl")  # expect: set-device-order
    model = nn.Linear(10, 1).cuda()  # expect: hardcoded-device
    model = DDP(model)
    batch = torch.randn(16, 10).to("cuda")  # expect: hardcoded-device
    loss = model(batch).mean()
    loss.backward()
    print(rank, loss.item())


if __name__ == "__main__":
    main()
