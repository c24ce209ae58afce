"""Workers a file starts itself (assistant/lint/checks/own_launcher.py):
launched-without-torchrun, RANK and WORLD_SIZE but no MASTER_ADDR / MASTER_PORT, joined
over env:// (the fixture really fails that way when run with python, and its twin
joins); cuda-visible-devices-mismatch, one GPU per worker through CUDA_VISIBLE_DEVICES and
the device then picked by rank (a GPU-only failure: "invalid device ordinal", read
from the text)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import lint_snippet

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "scripts"
BROKEN = SCRIPTS / "own_launcher_without_the_master_address.py"
FIXED = SCRIPTS / "correct_own_launcher_sets_the_master_address.py"
WAIT_SECONDS = 120

HEADER = """
import os
import subprocess
import sys
import torch.distributed as dist
import torch.multiprocessing as mp
"""

# blind set gg's 19: one multiprocessing.Process per GPU, each given its variables
LAUNCHER = """
def worker(rank, world):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    SETS
    dist.init_process_group(INIT)


def main():
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, 2)) for r in range(2)]
    for p in procs:
        p.start()
"""


def reported(sets: str = "pass", init: str = '"nccl"', launcher: str = LAUNCHER) -> list[int]:
    body = launcher.replace("SETS", sets).replace("INIT", init)
    return [line for line, _ in lint_snippet(HEADER, body, ["launched-without-torchrun"])]


def test_a_launcher_that_sets_rank_and_world_size_only_is_reported_at_the_init():
    assert reported() == [5]
    [(_, finding)] = lint_snippet(
        HEADER, LAUNCHER.replace("SETS", "pass").replace("INIT", '"nccl"'),
        ["launched-without-torchrun"],
    )  # fmt: skip
    assert "starts the workers itself (ctx.Process, line " in finding.message
    assert "MASTER_ADDR expected, but not set" in finding.message


@pytest.mark.parametrize(
    "sets, init",
    [
        ('os.environ["MASTER_ADDR"] = "127.0.0.1"', '"nccl"'),  # sets the master
        ("os.environ.update(MASTER_PORT=str(29500))", '"nccl"'),
        ("pass", '"nccl", init_method="tcp://127.0.0.1:29500"'),  # not env://
        ("pass", '"nccl", "tcp://127.0.0.1:29500"'),
        ("pass", '"nccl", store=dist.TCPStore("127.0.0.1", 29500)'),
        # a launcher that sets them: torch.distributed.run called from the file
        ("subprocess.run([sys.executable, '-m', 'torch.distributed.run', 'x.py'])", '"nccl"'),
    ],
)
def test_quiet_where_the_rendezvous_has_its_master(sets, init):
    assert reported(sets, init) == []


def test_quiet_without_workers_of_the_files_own_or_without_rank_variables():
    single = LAUNCHER.replace("procs = [ctx.Process(target=worker, args=(r, 2)) for r in range(2)]",
                              "procs = []")  # fmt: skip
    assert reported(launcher=single) == []
    no_variables = LAUNCHER.replace(
        'os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})', "pass"
    )
    assert reported(launcher=no_variables) == []


def run_with_python(script: Path, folder: Path) -> tuple[str, str]:
    """(stdout, stderr) of `python script`, its whole process group killed if it
    outlives the wait (the workers it spawned with it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)  # as a person's shell has them: unset
    run = subprocess.Popen(
        [sys.executable, str(script)], cwd=folder, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        return run.communicate(timeout=WAIT_SECONDS)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()


@pytest.mark.slow
def test_the_workers_fail_without_the_master_and_the_twins_join(tmp_path):
    out, err = run_with_python(BROKEN, tmp_path)
    assert err.count("environment variable MASTER_ADDR expected, but not set") == 2, err[-2000:]
    assert "exit codes [1, 1]" in out
    out, err = run_with_python(FIXED, tmp_path)
    assert "joined rank 0 of 2" in out and "joined rank 1 of 2" in out, err[-2000:]
    assert "exit codes [0, 0]" in out, err[-2000:]


# blind sets gg's 03 and gl's 20: each worker pinned to one GPU, then its device by rank
PINNED = """
def start(gpus, port):
    procs = []
    for local_rank, gpu in enumerate(gpus):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=ONE_GPU, LOCAL_RANK=str(local_rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env))
    return procs


def worker():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(PICK)
    model = DDP(net.cuda(), device_ids=[PICK])
"""


def pinned(visible: str = "gpu", pick: str = "local_rank") -> list[tuple[int, str]]:
    body = PINNED.replace("ONE_GPU", visible).replace("PICK", pick)
    header = HEADER + "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
    found = lint_snippet(header, body, ["cuda-visible-devices-mismatch"])
    return [(line, finding.message) for line, finding in found]


def test_one_visible_gpu_per_worker_picked_by_rank_is_reported_once():
    [(line, message)] = pinned()
    assert line == 13
    assert "CUDA_VISIBLE_DEVICES gives each worker one GPU" in message
    assert "picking the device by local_rank (and again on line " in message
    assert "invalid device ordinal" in message


@pytest.mark.parametrize(
    "visible, pick",
    [
        ("gpu", "0"),  # the worker's only GPU, as it sees it (gg's 07 and 13, gl's 02)
        ('",".join(gpus)', "local_rank"),  # every worker sees them all: by rank is right
        ("os.environ.get('CUDA_VISIBLE_DEVICES', '0')", "local_rank"),
    ],
)
def test_quiet_where_the_worker_sees_the_gpu_it_picks(visible, pick):
    assert pinned(visible, pick) == []


def test_a_gpu_taken_by_index_or_given_as_the_rank_is_one_gpu():
    assert len(pinned(visible="gpus[local_rank]")) == 1
    assert len(pinned(visible="str(local_rank)")) == 1
    assert len(pinned(visible='f"{gpu}"')) == 1
