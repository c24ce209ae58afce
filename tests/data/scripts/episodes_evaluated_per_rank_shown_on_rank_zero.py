"""A policy evaluated over episodes dealt out by rank (each rank plays
eval_episodes // world of them), and the mean return rank 0 prints and keeps
as the best: rank 0's own episodes only.

Runs under torchrun on CPU ranks (gloo): the episodes' returns are 0..7, rank 0
plays 0..3 (mean 1.5), rank 1 plays 4..7; the whole evaluation's mean is 3.5."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

EVAL_EPISODES = 8


def play(agent, episode):
    with torch.no_grad():
        agent(torch.zeros(1, 4))
    return float(episode)


def run_eval(agent, episodes, first):
    return [play(agent, first + i) for i in range(episodes)]


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    agent = DDP(nn.Linear(4, 2))
    per_rank = EVAL_EPISODES // world
    returns = run_eval(agent.module, per_rank, first=rank * per_rank)  # expect: metrics-not-reduced
    eval_mean = sum(returns) / len(returns)
    if rank == 0:
        print(f"eval return {eval_mean:.2f}", flush=True)
    del agent
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
