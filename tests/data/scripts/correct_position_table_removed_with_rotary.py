"""The twin of position_table_left_after_rotary.py: the learned position table
of the older version is gone with the switch to rotary positions, so every
parameter DDP holds gets a gradient each step.

Runs under torchrun (gloo, CPU) and trains.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, WIDTH, BLOCK = 64, 16, 8


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions over the last dimension (half of it rotated by each position)."""
    half = x.size(-1) // 2
    angles = torch.arange(x.size(1)).unsqueeze(-1) / (10_000 ** (torch.arange(half) / half))
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, WIDTH),
                mix=nn.Linear(WIDTH, WIDTH),
            )
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = rotate(self.transformer.wte(idx))
        x = x + torch.relu(self.transformer.mix(x))
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(GPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        idx = torch.randint(0, VOCAB, (4, BLOCK))
        loss = model(idx, torch.roll(idx, -1, dims=1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
