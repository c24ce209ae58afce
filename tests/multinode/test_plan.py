"""The multi-node plan: doctor's options and srun's SLURM_* -> what torchrun is told."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from assistant.cli import main
from assistant.errors import UserError
from assistant.probing.multinode import (
    RDZV_ID,
    NodesPlan,
    NodesRunner,
    connected_to_port,
    first_host,
    hosts_endpoint,
    parse_endpoint,
    plan_from_options,
)
from assistant.probing.protocol import NNODES_ENV, NODE_RANK_ENV, RDZV_ENDPOINT_ENV
from assistant.probing.runner import ProbeRunner


def test_master_options_become_the_rendezvous_endpoint():
    plan = NodesPlan.from_options(2, 1, "node-1", 29511)
    assert (plan.rdzv_host, plan.rdzv_port, plan.endpoint) == ("node-1", 29511, "node-1:29511")
    assert (plan.master_addr, plan.master_port) == ("node-1", 29511)


def test_rdzv_endpoint_wins_and_defaults_its_port():
    assert NodesPlan.from_options(2, 0, rdzv_endpoint="head:1234").endpoint == "head:1234"
    assert NodesPlan.from_options(2, 0, rdzv_endpoint="head").rdzv_port == 29500
    assert NodesPlan.from_options(2, 0, rdzv_endpoint="[fe80::1]:7").endpoint == "[fe80::1]:7"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((2, None, "h", 1), "--node-rank is needed"),
        ((2, 2, "h", 1), "outside 0..1"),
        ((2, 0, None, None), "--master-addr"),
        ((0, 0, "h", 1), "--nnodes"),
    ],
)
def test_bad_plans_are_one_line_user_errors(args, words):
    with pytest.raises(UserError, match=words):
        NodesPlan.from_options(*args)


def test_parse_endpoint_refuses_garbage():
    with pytest.raises(UserError):
        parse_endpoint("a b:c")
    assert parse_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("node7", "node7"),
        ("a1,b2", "a1"),
        ("rack[1-2]-n", "rack1-n"),
        ("", None),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_slurm_plan_reads_srun_variables():
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[10-13]"}
    plan = NodesPlan.from_slurm(env)
    assert (plan.nnodes, plan.node_rank, plan.endpoint, plan.source) == (
        4,
        2,
        "gpu10:29500",
        "slurm",
    )
    env["MASTER_ADDR"], env["MASTER_PORT"] = "head", "4242"
    assert NodesPlan.from_slurm(env).endpoint == "head:4242"


def test_slurm_without_srun_says_how_to_run_it():
    with pytest.raises(UserError, match="srun --ntasks-per-node=1"):
        NodesPlan.from_slurm({})


def test_no_node_option_means_the_single_machine_doctor():
    assert plan_from_options({}) is None
    with pytest.raises(UserError, match="need --nnodes"):
        plan_from_options({}, node_rank=1)
    with pytest.raises(UserError, match="--slurm reads"):
        plan_from_options({"SLURM_NNODES": "2", "SLURM_NODEID": "0"}, slurm=True, nnodes=2)


def test_torchrun_line_is_elastic_with_the_join_timeout_as_last_call(tmp_path):
    plan = NodesPlan.from_options(3, 1, "10.9.9.9", 29555, join_timeout=42)
    runner = NodesRunner(ProbeRunner(nproc_per_node=1), plan)
    command = runner.command(tmp_path)
    assert "--nnodes=1:3" in command and "--nproc-per-node=1" in command
    assert "--rdzv-backend=c10d" in command and f"--rdzv-id={RDZV_ID}" in command
    conf = next(arg for arg in command if arg.startswith("--rdzv-conf="))
    assert "last_call_timeout=42" in conf and "join_timeout=57" in conf
    assert "is_host" not in conf  # 10.9.9.9 is no address of this machine
    env = runner.environment(tmp_path, tmp_path / "tmp")
    assert (env[NODE_RANK_ENV], env[NNODES_ENV], env[RDZV_ENDPOINT_ENV]) == (
        "1",
        "3",
        "10.9.9.9:29555",
    )


def test_only_a_local_non_loopback_endpoint_is_hosted_explicitly():
    assert hosts_endpoint("127.0.0.1") is False  # two agents on one machine settle it
    assert hosts_endpoint("192.0.2.123") is False  # TEST-NET: nobody's address


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--node-rank", "1"], "need --nnodes"),
        (["--nnodes", "2", "--node-rank", "0"], "--master-addr"),
        (["--nnodes", "2", "--node-rank", "5", "--master-addr", "h"], "outside"),
        (["--slurm"], "SLURM_NNODES"),
    ],
)
def test_doctor_refuses_bad_node_options_in_one_line(args, words, monkeypatch):
    for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(main, ["doctor", *args])
    assert result.exit_code == 2
    assert words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_launch_outcomes_become_the_nodes_run():
    from assistant.probing.multinode import nodes_run

    plan = NodesPlan.from_options(2, 1, "head", 29500, join_timeout=10)
    error = "RendezvousConnectionError: The connection to the C10d store has failed."
    tail = [f"torch.distributed.elastic.rendezvous.api.{error}"]
    failed = nodes_run("exit", None, tail, 25.0, plan)
    assert failed.status == "error"
    assert failed.detail.startswith(
        "node 1 could not join the rendezvous at head:29500 within 10 s"
    )
    assert "RendezvousConnectionError" in failed.detail
    answered = {"status": "failed", "problems": ["node rank(s) 0 never joined"], "facts": {}}
    assert nodes_run("exit", answered, [], 20.0, plan).detail == "node rank(s) 0 never joined"
    assert nodes_run("timeout", None, [], 175.0, plan).status == "timeout"
    assert nodes_run("cancelled", None, [], 1.0, plan).status == "interrupted"
    running = {"status": "running", "reason": "", "facts": {}}
    cut = nodes_run("exit", running, ["Killed"], 30.0, plan)
    assert cut.status == "error" and cut.ranks == [running] and "while running" in cut.detail


def test_a_connection_to_the_endpoint_port_is_seen_in_the_process_that_holds_it():
    """How the agent knows torchrun is in the rendezvous (its start allowance is over)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # a stranger's listener: connections complete in its backlog
        port = listener.getsockname()[1]
        assert not connected_to_port(os.getpid(), port)
        with socket.create_connection(("127.0.0.1", port)):
            assert connected_to_port(os.getpid(), port)
            assert not connected_to_port(os.getpid(), port + 1 if port < 65535 else port - 1)
            # another process does not hold this connection, and a finished one holds nothing
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            try:
                assert not connected_to_port(child.pid, port)
            finally:
                child.kill()
                child.wait()
            assert not connected_to_port(child.pid, port)
