"""A model that drops its style encoder at random on some steps, under a DDP told to
look for unused parameters (no finding expected).

Runs under torchrun: DDP marks the skipped encoder's parameters ready itself.
"""

import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Styled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.style_encoder = nn.Linear(4, 4)
        self.null_style = nn.Parameter(torch.zeros(4))
        self.out = nn.Linear(4, 1)

    def style(self, reference: torch.Tensor) -> torch.Tensor:
        if random.random() < 0.5:
            return self.null_style.expand_as(reference)
        return self.style_encoder(reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.style(x))


def main() -> None:
    dist.init_process_group("gloo")
    random.seed(0)  # the same draws on every rank: the failure is DDP's, not a disagreement
    model = DDP(Styled(), find_unused_parameters=True)
    for _ in range(8):
        model(torch.randn(2, 4)).sum().backward()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
