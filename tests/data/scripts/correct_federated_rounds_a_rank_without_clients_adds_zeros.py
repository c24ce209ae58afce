"""The twin of federated_rounds_a_rank_without_clients_skips.py: a rank that draws no
client in a round adds zeros and still calls every all_reduce of the round:

    torchrun --nproc_per_node=2 train.py

Runs under torchrun (gloo, CPU): both ranks finish all three rounds.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

# The clients each round samples (a seeded draw, the same on every rank).
DRAWS = [[0], [0, 1, 2, 3], [1, 2]]
STEPS = 3


def local_update(model: nn.Module, client: int) -> torch.Tensor:
    """The client's trained weights minus the global ones, from a copy of the model."""
    local = nn.Linear(4, 1)
    local.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(client)
    for _ in range(STEPS):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
        loss = (local(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.cat(
        [(a - b).detach().flatten() for a, b in zip(local.parameters(), model.parameters())]
    )


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    for rnd, picked in enumerate(DRAWS):
        mine = [c for c in picked if c % world == rank]
        delta = torch.zeros(5)
        count = torch.zeros(1)
        for client in mine:
            delta += local_update(model, client)
            count += 1
        dist.all_reduce(delta)
        dist.all_reduce(count)
        with torch.no_grad():
            offset = 0  # some rank drew a client in every round: count is at least 1
            for p in model.parameters():
                p += (delta[offset : offset + p.numel()] / count).view_as(p)
                offset += p.numel()
        print(f"rank {rank} round {rnd}: {len(mine)} clients", flush=True)
    print(f"rank {rank} finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
