"""PPO-style updates under DDP: each rank collects whole episodes from its own
environment until it holds at least MIN_STEPS steps, then runs one backward per
minibatch of that rollout:

    torchrun --nproc_per_node=2 train.py

Episodes end when the environment says so, so each rank's rollout has its own
length and its own number of minibatches. Runs under torchrun (gloo, CPU): over
three updates rank 1 runs one backward more than rank 0, whose gradient
all-reduce no other rank joins; rank 0 has finished, and rank 1 fails
("Connection closed by peer").
"""

import random
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

MIN_STEPS = 16
MINIBATCH = 8


class Episodes:
    """A toy environment whose episodes last a number of steps its seed draws."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.left = 0

    def reset(self) -> torch.Tensor:
        self.left = self.rng.randint(3, 12)
        return torch.zeros(4)

    def step(self, action: torch.Tensor):
        self.left -= 1
        return torch.randn(4), float(action.sum()), self.left <= 0, False, {}


def collect(env: Episodes, model: nn.Module, min_steps: int) -> torch.Tensor:
    observations = []
    while len(observations) < min_steps:
        obs, done = env.reset(), False
        while not done:
            with torch.no_grad():
                action = model(obs[None])
            next_obs, _reward, terminated, truncated, _info = env.step(action)
            observations.append(obs)
            obs, done = next_obs, terminated or truncated
    return torch.stack(observations)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    env = Episodes(seed=rank)
    for update in range(3):
        obs = collect(env, model, MIN_STEPS)
        n = obs.shape[0]
        minibatches = 0
        for start in range(0, n - MINIBATCH + 1, MINIBATCH):  # expect: uneven-inputs
            loss = model(obs[start : start + MINIBATCH]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            minibatches += 1
        print(f"rank {rank} update {update}: {minibatches} minibatches", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
