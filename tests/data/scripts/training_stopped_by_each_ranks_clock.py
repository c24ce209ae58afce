"""Training for a wall-clock budget, each rank reading its own clock: the ranks
start their clocks at different moments (here rank 1 took longer to load), so
they stop after different numbers of steps. The rank that stops first goes on
to the stats all_reduce while the other is still in a step's gradient
all-reduce: gloo pairs them wrongly and the job fails (or hangs until the
group's timeout).

Runs under torchrun (gloo, CPU): it fails instead of printing "trained".
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
    while time.perf_counter() - start < BUDGET_S:  # expect: uneven-inputs
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
