"""A post-net that forward adds only once training passed a step count
(`x + self.postnet(x) if use_postnet else x`), under a DDP that expects every
parameter: before that step its parameters get no gradient."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Acoustic(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(8, 8)
        self.postnet = nn.Linear(8, 8)

    def forward(self, x, use_postnet=True):
        mel = self.decoder(x)
        return mel + self.postnet(mel) if use_postnet else mel


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(Acoustic().cuda(), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters())
    step, postnet_start = 0, 20_000
    while step < 100_000:
        x = torch.randn(4, 8, device="cuda")
        out = model(x, use_postnet=step >= postnet_start)  # expect: unused-parameters
        out.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
