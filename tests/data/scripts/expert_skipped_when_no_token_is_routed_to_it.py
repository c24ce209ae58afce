"""A mixture of experts under DDP whose loop over the experts skips one that got
no tokens this step: on the step where the router sends every token to expert 0,
expert 1's parameters get no gradient and DDP fails at the next step."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MoE(nn.Module):
    def __init__(self, width=8, experts=2):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x, route=None):
        scores = self.router(x).softmax(-1)
        weight, chosen = scores.max(-1)
        if route is not None:
            chosen = torch.full_like(chosen, route)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (chosen == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:  # expect: unused-parameters
                continue
            out[idx] = expert(x[idx]) * weight[idx, None]
        return out


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(MoE())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        # the first step routes every token to expert 0, as a skewed batch can
        out = model(torch.randn(16, 8), route=0 if step == 0 else None)
        optimizer.zero_grad()
        out.pow(2).mean().backward()
        optimizer.step()
    print(f"rank {dist.get_rank()} trained 3 steps", flush=True)
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
