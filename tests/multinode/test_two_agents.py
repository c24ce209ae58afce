"""Two real doctor agents on this machine over 127.0.0.1, through torchrun's c10d rendezvous.

Each agent is `python -m assistant doctor --json --nodes-only --nnodes 2
--node-rank R --master-addr 127.0.0.1 --master-port P`, a process of its
own, as on two nodes. No fakes: real torchrun, real store, real gloo.
"""

from __future__ import annotations

import pytest
from multinode_agents import REPO, confirmed, start_agent

from assistant.probing.machine import free_port
from assistant.probing.multinode import JOIN_MARGIN_SECONDS, RDZV_GRACE_SECONDS

pytestmark = pytest.mark.slow
JOIN = 30  # --join-timeout of the tests where both nodes come


def pair_args(join: float = JOIN) -> list[str]:
    port = str(free_port())
    return ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
            "--join-timeout", str(join), "--nproc-per-node", "2"]  # fmt: skip


def test_two_healthy_nodes_confirm_nothing_and_reduce_across_nodes():
    args = pair_args()
    agents = [start_agent(0, args), start_agent(1, args)]
    for agent in agents:
        agent.finish()
    for agent in agents:
        assert agent.code == 0, agent.stderr[-2000:]
        assert confirmed(agent) == []
        nodes = agent.nodes()
        assert sorted(nodes) == [0, 1]
        for node in nodes.values():
            assert node["joined"] and node["hostname"]
            assert node["versions"]["torch"].startswith("2.")
            assert node["told"]["nnodes"] == 2 and node["told"]["nproc_per_node"] == 2
            gloo = node["collectives"]["gloo"]
            assert gloo["result"] == "ok" and gloo["gbps"] > 0
        assert agent.cause("world-size-mismatch")["verdict"] == "ruled_out"
        # both agents run in the repository: one folder, so it is shared
        for entry in agent.nodes().values():
            assert node_verdict(entry, "checkpoint-on-node-local-disk")["verdict"] == "ruled_out"
        assert {p["name"] for p in agent.result["probes"]} == {"nodes"}
    assert not list(REPO.glob(".ddp-assistant-storage-check*"))  # the markers are gone


def test_a_bogus_gloo_ifname_is_confirmed_for_that_node():
    args = pair_args()
    agents = [start_agent(0, args), start_agent(1, args, env={"GLOO_SOCKET_IFNAME": "bogus0"})]
    for agent in agents:
        agent.finish()
    for agent in agents:  # both nodes say it, about node 1
        assert agent.code == 0, agent.stderr[-2000:]
        cause = agent.cause("network-interface")
        assert cause["verdict"] == "confirmed"
        assert cause["evidence"][0].startswith("node 1 (")
        assert "GLOO_SOCKET_IFNAME=bogus0" in cause["evidence"][0]
        verdicts = {
            n: {v["id"]: v["verdict"] for v in e["verdicts"]} for n, e in agent.nodes().items()
        }
        assert verdicts[1]["network-interface"] == "confirmed"
        assert verdicts[0]["network-interface"] == "ruled_out"
        assert agent.nodes()[0]["collectives"]["gloo"]["result"] == "skipped"


def test_a_missing_node_is_named_within_the_join_timeout():
    join = 8
    endpoint = f"127.0.0.1:{free_port()}"  # the --rdzv-endpoint form of the same thing
    args = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--join-timeout", str(join)]
    agent = start_agent(0, args).finish()
    assert agent.code == 1  # a check failed
    assert "never joined" in agent.stderr and "Traceback" not in agent.stderr
    nodes = agent.nodes()
    assert nodes[1]["joined"] is False and nodes[0]["joined"] is True
    cause = agent.cause("world-size-mismatch")
    assert cause["verdict"] == "confirmed" and "node rank 1 never joined" in cause["evidence"][0]
    # the join timeout, torchrun's start and the probe: well under the outer deadline
    assert agent.seconds < join + 90


def test_one_node_job_runs_this_nodes_probes_too():
    """Without --nodes-only the node's own probes run after the nodes check, as in doctor."""
    import json
    import subprocess
    import sys

    from multinode_agents import AGENT_LIMIT, REPO

    args = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--join-timeout", "10"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "assistant", "doctor", "--json", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=AGENT_LIMIT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    probes = {p["name"] for p in result["probes"]}
    assert {"nodes", "devices", "versions", "system", "rendezvous"} <= probes
    assert [n["node_rank"] for n in result["nodes"]] == [0]


def test_slurm_form_under_srun_variables():
    """What `srun --ntasks-per-node=1 assistant doctor --slurm` gives each node."""
    port = str(free_port())
    agents = []
    for rank in (0, 1):
        env = {"SLURM_NNODES": "2", "SLURM_NODEID": str(rank), "SLURM_JOB_NODELIST": "localhost",
               "MASTER_PORT": port}  # fmt: skip
        command = ["--slurm", "--join-timeout", str(JOIN)]
        agents.append(start_agent(rank, command, env=env, node_rank=False))
    for agent in agents:
        agent.finish()
    for agent in agents:
        assert agent.code == 0, agent.stderr[-2000:]
        nodes = agent.nodes()
        assert sorted(nodes) == [0, 1]
        assert {n["told"]["master_addr"] for n in nodes.values()} == {"localhost"}


def test_a_stranger_on_the_endpoint_port_is_named_and_nothing_hangs():
    """A plain listener (an old job, another service) holds the port this node would serve."""
    import socket

    join = 5
    with socket.socket() as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind(("0.0.0.0", 0))
        stranger.listen(8)
        port = str(stranger.getsockname()[1])
        args = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
                "--join-timeout", str(join)]  # fmt: skip
        agent = start_agent(0, args).finish()
    assert agent.code == 1 and "Traceback" not in agent.stderr
    assert agent.nodes()[0]["joined"] is False and agent.nodes()[0]["error"]
    cause = agent.cause("master-port-in-use")
    assert cause["verdict"] == "confirmed"
    assert f"port {port} was already in use on node 0" in cause["evidence"][0]
    assert agent.cause("master-endpoint-mismatch")["verdict"] == "inconclusive"
    # torchrun would wait in the stranger's handshake for minutes. Once it is connected to
    # the port only the rendezvous is waited for, not the start allowance on top
    # (START_SECONDS, for a slow interpreter): join + margin + grace + its start.
    assert agent.seconds < join + JOIN_MARGIN_SECONDS + RDZV_GRACE_SECONDS + 20


def node_verdict(entry: dict, cause_id: str) -> dict:
    """One node's verdict on a cross-node cause, from `doctor --json`'s "nodes"."""
    return next(v for v in entry["verdicts"] if v["id"] == cause_id)


def private_mount_unavailable() -> str | None:
    """Why a mount namespace with a tmpfs of its own cannot be made here, or None."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a private mount needs root and unshare"
    probe = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs none /mnt"]  # fmt: skip
    done = subprocess.run(probe, capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"unshare --mount fails here: {done.stderr.strip()}"


def test_a_checkpoint_folder_on_one_nodes_own_disk_is_named_and_nothing_is_left(tmp_path):
    """Node 1 sees another disk at the same path (its own mount namespace, a tmpfs
    over the folder), as a second machine's local disk: both nodes name it."""
    reason = private_mount_unavailable()
    if reason:
        pytest.skip(reason)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    args = [*pair_args(), "--storage-dir", str(folder)]
    private = ["unshare", "--mount", "--propagation", "private",
               "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"', str(folder)]  # fmt: skip
    agents = [start_agent(0, args), start_agent(1, args, prefix=private)]
    for agent in agents:
        agent.finish()
    for agent in agents:
        assert agent.code == 0, agent.stderr[-2000:]
        for entry in agent.nodes().values():  # each node misses the other's file
            found = node_verdict(entry, "checkpoint-on-node-local-disk")
            assert found["verdict"] == "confirmed"
            assert str(folder) in found["evidence"][0] and "own disk" in found["evidence"][0]
            assert node_verdict(entry, "network-interface")["verdict"] == "ruled_out"
    assert list(folder.iterdir()) == []  # node 0's marker removed; node 1's was on its tmpfs
