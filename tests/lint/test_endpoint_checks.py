"""master-endpoint-mismatch: MASTER_ADDR set to each process's own host name in a
file that shows several nodes (assistant/lint/checks/endpoint.py). The failure
itself needs two hosts: the doctor's two-agent tests in network namespaces
show what such a rendezvous does (tests/multinode)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import lint_snippet

from assistant.lint import lint_script

HEADER = """
import os
import socket
import subprocess
import torch.distributed as dist
"""


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["master-endpoint-mismatch"])]


@pytest.mark.parametrize(
    "body",
    [
        'node = int(os.environ["SLURM_NODEID"])\nos.environ["MASTER_ADDR"] = socket.gethostname()',
        (
            'nodes = int(os.environ["SLURM_NNODES"])\n'
            'os.environ.setdefault("MASTER_ADDR", socket.gethostbyname(socket.getfqdn()))'
        ),
        (
            'host = socket.gethostname()\nnode = int(os.environ["NODE_RANK"])\n'
            'dist.init_process_group("nccl", init_method=f"tcp://{host}:29500", rank=0, world_size=2)'
        ),
    ],
)
def test_each_nodes_own_host_name_as_the_master_is_reported(body):
    assert reported(body) != []


@pytest.mark.parametrize(
    "body",
    [
        # one machine: its own host name is the master's
        'os.environ["MASTER_ADDR"] = socket.gethostname()',
        # srun's task variables alone: one node may run them all
        'rank = int(os.environ["SLURM_PROCID"])\nos.environ["MASTER_ADDR"] = socket.gethostname()',
        # rank 0's host name, sent to every process
        (
            'node = int(os.environ["SLURM_NODEID"])\n'
            'os.environ["MASTER_ADDR"] = comm.bcast(socket.gethostname(), root=0)'
        ),
        # the job's first host
        (
            'nodes = os.environ["SLURM_JOB_NODELIST"]\n'
            'first = subprocess.check_output(["scontrol", "show", "hostnames", nodes]).split()[0]\n'
            'os.environ["MASTER_ADDR"] = first.decode()'
        ),
    ],
)
def test_one_machine_or_a_shared_address_is_quiet(body):
    assert reported(body) == []


def test_the_fixture_is_reported_on_its_line():
    from pathlib import Path

    path = Path(__file__).parents[1] / "data" / "scripts" / "master_addr_of_each_node_under_srun.py"
    [finding] = [f for f in lint_script(path) if f.cause_id == "master-endpoint-mismatch"]
    assert "own host name" in finding.message and "scontrol" in finding.message


SPAWNED = """
import os
import random
import socket
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    s = socket.socket()
    s.bind(("", 0))
    return s.getsockname()[1]


def worker(rank, world):
    WORKER
    dist.init_process_group("gloo", rank=rank, world_size=world)


if __name__ == "__main__":
    PARENT
    mp.spawn(worker, args=(2,), nprocs=2)
"""


@pytest.mark.parametrize(
    ("worker", "parent", "reported"),
    [
        # blind set fq's 15: each spawned process asks the OS for its own free port
        ('os.environ["MASTER_PORT"] = str(free_port())', "pass", [16]),
        ('os.environ["MASTER_PORT"] = str(random.randint(20000, 30000))', "pass", [16]),
        # chosen once in the parent, which the children inherit
        ("pass", 'os.environ["MASTER_PORT"] = str(free_port())', []),
        ('os.environ["MASTER_PORT"] = "29500"', "pass", []),
    ],
    ids=["free-port", "random", "parent", "fixed"],
)
def test_a_master_port_chosen_in_each_spawned_process(worker, parent, reported):
    source = SPAWNED.replace("WORKER", worker).replace("PARENT", parent)
    found = lint_snippet("", source, ["master-endpoint-mismatch"])
    assert [line for line, _ in found] == reported


def test_a_port_the_parent_chose_and_passed_is_the_same_in_every_child():
    # blind sets d's 18, g's 16 (correct): `port = free_port()` in the parent, handed on
    source = (
        "import os\nimport socket\nimport torch.distributed as dist\nimport torch.multiprocessing as mp\n"
        "def free_port():\n    s = socket.socket()\n    s.bind(('', 0))\n    return s.getsockname()[1]\n"
        "def worker(rank, world, port):\n"
        "    os.environ['MASTER_PORT'] = str(port)\n"
        "    dist.init_process_group('gloo', rank=rank, world_size=world)\n"
        "if __name__ == '__main__':\n"
        "    port = free_port()\n"
        "    mp.spawn(worker, args=(2, port), nprocs=2)\n"
    )
    assert lint_snippet("", source, ["master-endpoint-mismatch"]) == []


# blind sets gg's 11 and gl's 01: a Popen launcher whose helper builds each worker's
# environment, drawing a free port every call
LAUNCHER = """
import os
import socket
import subprocess
import sys


def find_free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_env(rank, port):
    return dict(os.environ, RANK=str(rank), MASTER_PORT=PORT_GIVEN)


def launch(nproc):
    CHOSEN
    procs = []
    for rank in range(nproc):
        procs.append(subprocess.Popen([sys.executable, "train.py"], env=worker_env(rank, port)))
"""


@pytest.mark.parametrize(
    ("port", "chosen", "reported"),
    [
        ("str(find_free_port())", "port = None", [15]),  # drawn anew for each worker
        ("str(port)", "port = find_free_port()", []),  # once, before the loop
        ("'29500'", "port = None", []),
    ],
)
def test_a_master_port_chosen_anew_for_each_worker_a_loop_starts(port, chosen, reported):
    source = LAUNCHER.replace("PORT_GIVEN", port).replace("CHOSEN", chosen)
    found = lint_snippet("", source, ["master-endpoint-mismatch"])
    assert [line for line, _ in found] == reported


def test_a_port_drawn_in_the_loop_that_starts_the_workers_is_per_worker_too():
    source = (
        LAUNCHER.replace("PORT_GIVEN", "str(port)")
        .replace("CHOSEN", "port = None")
        .replace(
            "env=worker_env(rank, port)",
            "env=dict(os.environ, MASTER_PORT=str(find_free_port()))",
        )
    )
    [(line, finding)] = lint_snippet("", source, ["master-endpoint-mismatch"])
    assert line == 22
    assert "once per pass of the loop on line 21 that starts them" in finding.message


@pytest.mark.slow
def test_workers_told_other_ports_never_meet_and_the_twin_joins(tmp_path):
    """Run with python: the broken launcher's workers time out in the rendezvous
    (rank 0's store waits for a client that connects elsewhere); the twin's join."""
    from test_own_launcher import run_with_python

    from assistant.lint import lint_script as lint

    scripts = Path(__file__).resolve().parent.parent / "data" / "scripts"
    broken = scripts / "launcher_port_per_worker.py"
    assert [f.cause_id for f in lint(broken)] == ["master-endpoint-mismatch"]
    out, err = run_with_python(broken, tmp_path)
    assert "exit codes [1, 1]" in out, err[-2000:]
    assert "waiting for clients. 1/2 clients joined" in err
    out, err = run_with_python(scripts / "correct_launcher_port_chosen_once.py", tmp_path)
    assert "joined rank 0 of 2" in out and "joined rank 1 of 2" in out, err[-2000:]


def test_a_port_drawn_once_before_the_loop_is_every_workers():
    # blind sets gg's 08 and gl's 20: drawn before the loop, written into each environment
    source = (
        LAUNCHER.replace("PORT_GIVEN", "str(port)")
        .replace("CHOSEN", "port = find_free_port()")
        .replace("env=worker_env(rank, port)", "env=dict(os.environ, MASTER_PORT=str(port))")
    )
    assert lint_snippet("", source, ["master-endpoint-mismatch"]) == []
