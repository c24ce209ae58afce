"""The fix of aux_output_in_the_loss_after_a_warmup.py (no finding expected):
the auxiliary term is in the loss every step, weighted 0 during the warmup,
so every parameter gets a gradient (of zero) each step."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

AUX_START = 1000


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.graph_head = nn.Linear(16, 1)
        self.atom_head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.graph_head(h).squeeze(-1), self.atom_head(h)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(MultiTask())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    for _ in range(3):
        x, y, atoms = torch.randn(16, 8), torch.randn(16), torch.randint(0, 4, (16,))
        graph_out, atom_logits = model(x)
        aux_weight = 0.1 if step >= AUX_START else 0.0
        aux = nn.functional.cross_entropy(atom_logits, atoms)
        loss = nn.functional.mse_loss(graph_out, y) + aux_weight * aux
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
    print(f"trained rank {dist.get_rank()}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
