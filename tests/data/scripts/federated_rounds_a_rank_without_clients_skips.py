"""Federated averaging simulated on the ranks: each round samples clients (the same
draw on every rank), each rank trains the clients that fall to it, and the ranks
average the updates with all_reduce:

    torchrun --nproc_per_node=2 train.py

A rank that draws no client in a round skips the round, its all_reduces included.
Runs under torchrun (gloo, CPU): round 0 draws only client 0 (rank 0's), so rank 1
goes on to round 1 and its all_reduces meet rank 0's of round 0; rank 1 runs out of
rounds first and leaves, and rank 0 fails in an all_reduce no rank joins
("Connection closed by peer").
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
        if not mine:  # expect: collective-mismatch
            continue
        delta = torch.zeros(5)
        count = torch.zeros(1)
        for client in mine:
            delta += local_update(model, client)
            count += 1
        dist.all_reduce(delta)
        dist.all_reduce(count)
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                p += (delta[offset : offset + p.numel()] / count).view_as(p)
                offset += p.numel()
        print(f"rank {rank} round {rnd}: {len(mine)} clients", flush=True)
    print(f"rank {rank} finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
