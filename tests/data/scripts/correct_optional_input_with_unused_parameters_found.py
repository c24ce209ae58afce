"""An optional input that skips a submodule, done right: DDP looks for unused
parameters, and the unconditional call at sampling time has no backward."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Denoiser(nn.Module):
    def __init__(self, classes=10, dim=64):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.label_embed = nn.Embedding(classes, dim)

    def forward(self, x, t, label=None):
        h = self.body(x) + t[:, None]
        if label is not None:
            h = h + self.label_embed(label)
        return h


@torch.no_grad()
def sample(model, x, t, label, scale=3.0):
    unconditional = model(x, t, None)
    return unconditional + scale * (model(x, t, label) - unconditional)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(Denoiser().cuda(local_rank), device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(100):
        x = torch.randn(8, 64, device=f"cuda:{local_rank}")
        t = torch.rand(8, device=x.device)
        label = torch.randint(0, 10, (8,), device=x.device)
        if torch.rand(()) < 0.1:
            label = None
        loss = (model(x, t, label) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    sample(model, x, t, label)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
