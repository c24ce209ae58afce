"""Forward returns a dict of heads; with --loss at its default the step reads only the
quantile head's entry, so the point head never gets a gradient (unused-parameters).

Under torchrun, DDP (without find_unused_parameters) fails at the second step:
"Expected to have finished reduction in the prior iteration".
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.quantile_head = nn.Linear(8, 3)
        self.point_head = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"quantiles": self.quantile_head(h), "point": self.point_head(h).squeeze(-1)}


def pinball(pred, y):
    q = torch.tensor([0.1, 0.5, 0.9])
    diff = y.unsqueeze(-1) - pred
    return torch.maximum(q * diff, (q - 1) * diff).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", choices=["quantile", "mse"], default="quantile")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = DDP(Forecaster())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        x, y = torch.randn(4, 8), torch.randn(4)
        out = model(x)
        if args.loss == "quantile":  # expect: unused-parameters
            loss = pinball(out["quantiles"], y)
        else:
            loss = F.mse_loss(out["point"], y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
