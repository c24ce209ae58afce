"""master-endpoint-mismatch: MASTER_ADDR set to each process's own host name in a
file that shows several nodes (assistant/lint/checks/endpoint.py). The failure
itself needs two hosts: the doctor's two-agent tests in network namespaces
show what such a rendezvous does (tests/multinode)."""

from __future__ import annotations

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
