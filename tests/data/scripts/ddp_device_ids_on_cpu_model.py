import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 1))

    def forward(self, x):
        return self.body(x)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    model = Net()
    model = DDP(model, device_ids=[local_rank])  # expect: ddp-device-ids-cpu-module
    model(torch.randn(3, 20)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
