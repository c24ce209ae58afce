"""A launcher written by hand: one process per worker, each given its RANK and
WORLD_SIZE, then init_process_group over env:// as if torchrun had started it.
torchrun would also have set MASTER_ADDR and MASTER_PORT; nothing here does.

Run with python (not torchrun): every worker fails with "environment variable
MASTER_ADDR expected, but not set".
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def worker(rank: int, world: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    dist.init_process_group("gloo")  # expect: launched-without-torchrun
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"joined rank {rank} of {int(total.item())}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    context = mp.get_context("spawn")
    workers = [context.Process(target=worker, args=(rank, WORLD)) for rank in range(WORLD)]
    for process in workers:
        process.start()
    for process in workers:
        process.join()
    print("exit codes", [process.exitcode for process in workers], flush=True)


if __name__ == "__main__":
    main()
