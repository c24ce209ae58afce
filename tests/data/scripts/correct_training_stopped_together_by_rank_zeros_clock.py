"""The twin of training_stopped_by_each_ranks_clock.py: rank 0 reads the clock and
broadcasts the decision each step, so every rank stops after the same step.

Runs under torchrun (gloo, CPU) and prints "trained" on each rank.
"""

import datetime
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

BUDGET_S = 1.5


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    time.sleep(0.5 * rank)  # rank 1 took longer to load its data: its clock starts later
    steps = 0
    start = time.perf_counter()
    while True:
        stop = torch.tensor([float(time.perf_counter() - start >= BUDGET_S)])
        dist.broadcast(stop, src=0)  # rank 0's clock decides for everyone
        if stop.item():
            break
        loss = model(torch.randn(4, 8)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    stats = torch.tensor([float(steps)])
    dist.all_reduce(stats)
    print(f"trained rank {rank}: {steps} steps, {int(stats.item())} in all", flush=True)
    dist.barrier()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
