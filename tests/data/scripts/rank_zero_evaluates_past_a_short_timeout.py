"""A job that shortens its process group's timeout to fail fast on hangs, then
each epoch lets rank 0 evaluate the whole validation set alone while the
other ranks wait in the barrier after it: an evaluation longer than the
timeout ends the job.

Runs under torchrun (a 4 s timeout, an evaluation of about 5 s): the
waiting rank times out in the barrier.
"""

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn


def evaluate(model: nn.Module, batches: list[torch.Tensor]) -> float:
    total = 0.0
    with torch.no_grad():
        for batch in batches:
            total += model(batch).sum().item()
            time.sleep(0.5)  # a real validation batch takes this long
    return total


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.Linear(4, 1)
    val_batches = [torch.randn(8, 4) for _ in range(10)]
    for epoch in range(2):
        if rank == 0:
            score = evaluate(model, val_batches)
            print(f"epoch {epoch} score {score:.3f}", flush=True)
        dist.barrier()  # expect: collective-timeout
    print("finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
