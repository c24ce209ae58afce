"""The twin of launcher_port_per_worker.py: the launcher draws one free port
before it starts any worker and gives every worker that one.

Run with python: both workers join and print their line.
"""

import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

WORLD = 2


def find_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_env(rank: int, port: int) -> dict[str, str]:
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def worker() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"joined rank {dist.get_rank()} of {int(total.item())}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def launch() -> None:
    workers = []
    port = find_free_port()  # one port for the whole job, before any worker starts
    for rank in range(WORLD):
        command = [sys.executable, os.path.abspath(__file__), "--worker"]
        workers.append(subprocess.Popen(command, env=worker_env(rank, port)))
    print("exit codes", [process.wait() for process in workers], flush=True)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else launch()
