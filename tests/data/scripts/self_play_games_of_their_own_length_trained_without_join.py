"""AlphaZero-style self-play under DDP: each rank plays its own games, then trains on
the positions it collected, with no agreement on the number of steps:

    torchrun --nproc_per_node=2 train.py

A game lasts until it ends, so each rank collects its own number of positions and
runs its own number of batches. Runs under torchrun (gloo, CPU): in the first
iteration rank 1 runs 6 batches and rank 0 4, so rank 1's extra backwards are
joined by rank 0's next iteration; the ranks fall out of step, rank 1 finishes
first, and rank 0 fails in a gradient all-reduce ("Connection closed by peer").
"""

import random
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

GAMES = 4
BATCH = 4


def play(model: nn.Module) -> list[tuple[torch.Tensor, float]]:
    """One game's positions, each with the game's outcome; the game ends when a draw says so."""
    positions = []
    while not positions or random.random() > 0.2:
        board = torch.randn(8)
        with torch.no_grad():
            model(board[None])
        positions.append((board, 0.0))
    outcome = random.choice([-1.0, 1.0])
    return [(board, outcome) for board, _ in positions]


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    random.seed(1 + rank)  # each rank plays games of its own
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for iteration in range(2):
        fresh = []
        for _ in range(GAMES):
            fresh += play(net)
        boards = torch.stack([board for board, _ in fresh])
        outcomes = torch.tensor([[outcome] for _, outcome in fresh])
        loader = DataLoader(TensorDataset(boards, outcomes), batch_size=BATCH, shuffle=True, drop_last=True)  # expect: uneven-inputs
        steps = 0
        for x, z in loader:
            loss = (model(x) - z).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
        print(f"rank {rank} iteration {iteration}: {steps} steps", flush=True)
    print(f"rank {rank} finished", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
