"""A model that still returns a pretraining head's output (a next-sentence
score) beside the one the step trains on; the step unpacks it into `_`. The
head's parameters never get a gradient, and DDP, told to expect one for every
parameter, fails on the second step with "Expected to have finished
reduction in the prior iteration". Runs on CPU ranks (gloo)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.lm_head = nn.Linear(16, 4)
        self.pooler = nn.Linear(16, 16)
        self.nsp_head = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        lm_logits = self.lm_head(h)
        nsp_logits = self.nsp_head(torch.tanh(self.pooler(h)))
        return lm_logits, nsp_logits


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Encoder())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        lm_logits, _ = model(x)  # expect: unused-parameters
        loss = nn.functional.cross_entropy(lm_logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"trained rank {dist.get_rank()}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
