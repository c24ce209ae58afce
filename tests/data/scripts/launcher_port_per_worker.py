"""A launcher written by hand that builds each worker's environment in a helper,
and the helper draws a free port every time it is called: every worker is told
another MASTER_PORT. Rank 0's store listens on its own port while rank 1 knocks
on another, and neither finishes init_process_group.

Run with python: both workers fail within the 10 s the group is given.
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


def worker_env(rank: int) -> dict[str, str]:
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(find_free_port()),  # expect: master-endpoint-mismatch
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
    for rank in range(WORLD):
        command = [sys.executable, os.path.abspath(__file__), "--worker"]
        workers.append(subprocess.Popen(command, env=worker_env(rank)))
    print("exit codes", [process.wait() for process in workers], flush=True)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else launch()
