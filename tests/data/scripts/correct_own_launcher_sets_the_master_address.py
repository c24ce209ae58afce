"""The twin of own_launcher_without_the_master_address.py: the launcher chooses one
free port and gives every worker MASTER_ADDR and MASTER_PORT with its RANK and
WORLD_SIZE, as torchrun would.

Run with python: both workers join and print their line.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"joined rank {rank} of {int(total.item())}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    port = free_port()  # one port for the whole job, chosen before any worker starts
    context = mp.get_context("spawn")
    workers = [context.Process(target=worker, args=(rank, WORLD, port)) for rank in range(WORLD)]
    for process in workers:
        process.start()
    for process in workers:
        process.join()
    print("exit codes", [process.exitcode for process in workers], flush=True)


if __name__ == "__main__":
    main()
