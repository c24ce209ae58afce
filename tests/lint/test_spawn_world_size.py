"""world-size-mismatch: a spawned worker counts its rank per process (node rank *
processes per node + index) while world_size stays the number of nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from snippets import free_port, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "spawn_world_size_of_nodes.py"
FIXED = SCRIPTS / "correct_spawn_world_size_of_processes.py"
WAIT_SECONDS = 60
# After the line awaited, what the other process does within this long is kept too.
STILL_WAITING_SECONDS = 3

HEADER = """
import os

import torch.distributed as dist
import torch.multiprocessing as mp
"""
WORKER = """
def main_worker(gpu, ngpus_per_node, args):
    args.rank = args.rank * ngpus_per_node + gpu
    dist.init_process_group("nccl", world_size=args.world_size, rank=args.rank)
"""


def spawned(script: Path, folder: Path, until: str, pod: bool = False) -> tuple[bool, str]:
    """(finished, what it printed): run until it exits, or until `until` is printed and
    a few seconds more; the whole group is killed after. `pod`: started as one pod of
    a PyTorchJob (its variables in the environment), not with --dist-url."""
    log = folder / f"{script.stem}.log"
    port = free_port()
    command = [sys.executable, str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if pod:
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                "WORLD_SIZE": "1"}  # fmt: skip
    else:
        command += ["--dist-url", f"tcp://127.0.0.1:{port}"]
    with log.open("w") as out:
        run = subprocess.Popen(command, cwd=folder, env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_SECONDS
        while run.poll() is None and time.monotonic() < deadline:
            if until in log.read_text():
                time.sleep(STILL_WAITING_SECONDS)
                break
            time.sleep(0.2)
        return run.poll() is not None, log.read_text()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()


@pytest.mark.slow
def test_rank_zero_trains_alone_and_rank_one_never_joins_while_the_twin_counts_both(tmp_path):
    # Rank 0 runs in a world of one; rank 1, outside it, waits or fails (which, and
    # how, depends on which process reaches the store first): it never counts two.
    _finished, out = spawned(BROKEN, tmp_path, until="rank 0 of 1: 1 processes")
    assert "rank 0 of 1: 1 processes" in out, out[-2000:]
    assert "of 2" not in out and "rank 1 of 1" not in out, out[-2000:]
    finished, out = spawned(FIXED, tmp_path, until="no line: it runs to the end")
    assert finished, out[-2000:]
    assert "rank 0 of 2: 2 processes" in out and "rank 1 of 2: 2 processes" in out


@pytest.mark.slow
def test_a_pods_spawned_rank_past_the_pod_count_never_joins_while_the_twin_counts_both(
    tmp_path,
):
    broken = SCRIPTS / "spawn_per_pod_world_size_from_the_environment.py"
    _finished, out = spawned(broken, tmp_path, until="rank 0 of 1: 1 processes", pod=True)
    assert "rank 0 of 1: 1 processes" in out, out[-2000:]
    assert "of 2" not in out and "rank 1 of 1" not in out, out[-2000:]
    fixed = SCRIPTS / "correct_spawn_per_pod_world_size_of_processes.py"
    finished, out = spawned(fixed, tmp_path, until="no line: it runs to the end", pod=True)
    assert finished, out[-2000:]
    assert "rank 0 of 2: 2 processes" in out and "rank 1 of 2: 2 processes" in out


POD_WORKER = """
def run(local_rank, ngpus):
    node = int(os.environ["RANK"])
    {world}
    rank = node * ngpus + local_rank
    dist.init_process_group("nccl", rank=rank, world_size=world)

def main(ngpus):
    mp.spawn(run, nprocs=ngpus, args=(ngpus,))
"""


@pytest.mark.parametrize(
    ("world", "reported"),
    [
        # RANK is the pod's index, so the same launcher's WORLD_SIZE counts pods
        ("world = int(os.environ['WORLD_SIZE'])", True),
        ("world = int(os.environ.get('WORLD_SIZE', 1))", True),
        ("world = int(os.environ['WORLD_SIZE']) * ngpus", False),
        ("world = ngpus * int(os.getenv('WORLD_SIZE'))", False),
    ],
)
def test_a_world_size_of_pods_from_the_environment_beside_a_rank_per_process(world, reported):
    body = POD_WORKER.format(world=world)
    found = [line for line, _f in lint_snippet(HEADER, body, ["world-size-mismatch"])]
    assert bool(found) == reported


def findings(body: str) -> list[int]:
    return [line for line, _f in lint_snippet(HEADER, WORKER + body, ["world-size-mismatch"])]


def test_a_world_size_of_nodes_is_reported_where_it_is_passed():
    body = """
    def main(args, ngpus):
        mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
    """
    assert findings(body) == [4]  # the init_process_group line of WORKER


@pytest.mark.parametrize(
    "scaling",
    [
        "args.world_size = ngpus * args.world_size",
        "args.world_size *= ngpus",
        "args.world_size = int(os.environ['WORLD_SIZE'])",
    ],
)
def test_a_world_size_scaled_or_read_from_the_launcher_is_quiet(scaling: str):
    body = f"""
    def main(args, ngpus):
        {scaling}
        mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
    """
    assert findings(body) == []


def test_a_rank_that_is_the_index_alone_is_not_judged():
    body = """
    def single(gpu, args):
        dist.init_process_group("nccl", world_size=args.world_size, rank=gpu)

    def main(args, ngpus):
        mp.spawn(single, nprocs=ngpus, args=(args,))
    """
    assert findings(body) == []
