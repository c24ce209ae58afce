"""The model of output_discarded_by_the_training_step.py with the fix: the step
trains on both outputs (the next-sentence score gets its own loss), so every
parameter gets a gradient each step."""

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
        lm_logits, nsp_logits = model(x)
        loss = nn.functional.cross_entropy(lm_logits, y) + nsp_logits.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"trained rank {dist.get_rank()}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
