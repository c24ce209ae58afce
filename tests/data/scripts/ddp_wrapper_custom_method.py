import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.steps = 3

    def forward(self, x):
        return self.body(x)

    @torch.no_grad()
    def generate(self, x):
        for _ in range(self.steps):
            x = self.body(x)
        return x


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(int(os.environ["RANK"]))
    model = DDP(Generator())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    sample = model.generate(torch.randn(1, 8))  # expect: ddp-wrapper-attribute
    print("sample", sample.shape, "steps", model.steps)  # expect: ddp-wrapper-attribute
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
