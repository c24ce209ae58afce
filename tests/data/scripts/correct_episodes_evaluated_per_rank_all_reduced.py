"""The same evaluation over episodes dealt out by rank, the ranks' sums and
counts all-reduced before rank 0 prints the mean: the whole evaluation's.

Runs under torchrun on CPU ranks (gloo): the mean of the returns 0..7, 3.5."""

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
    returns = run_eval(agent.module, per_rank, first=rank * per_rank)
    totals = torch.tensor([sum(returns), len(returns)], dtype=torch.float64)
    dist.all_reduce(totals)
    eval_mean = (totals[0] / totals[1]).item()
    if rank == 0:
        print(f"eval return {eval_mean:.2f}", flush=True)
    del agent
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
