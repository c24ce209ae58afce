"""Two doctor agents in two network namespaces joined by a veth pair (10.77.x.1 / 10.77.x.2).

Each node has a network stack of its own, with real interfaces and
addresses, so interface choice and reachability are exercised for real;
the traffic stays on this machine. Needs root and iproute2 (`ip netns`):
skipped with a message elsewhere. The namespaces are always deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest
from multinode_agents import confirmed, start_agent

from assistant.probing.machine import free_port

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Pair:
    """Two namespaces and their addresses: node 0 in `spaces[0]` at `addresses[0]`."""

    spaces: tuple[str, str]
    links: tuple[str, str]
    addresses: tuple[str, str]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "ip netns needs root"
    probe = f"ddpa-check-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add fails here: {getattr(exc, 'stderr', '') or exc}".strip()
    ip("netns", "del", probe)
    return None


@pytest.fixture
def pair():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 250 + 1  # a subnet and names of this test run's own
    pair = Pair(
        (f"ddpa-{tag}-a", f"ddpa-{tag}-b"),
        (f"ddpa{tag}a", f"ddpa{tag}b"),
        (f"10.77.{tag}.1", f"10.77.{tag}.2"),
    )
    try:
        for space in pair.spaces:
            ip("netns", "add", space)
            ip("-n", space, "link", "set", "lo", "up")
        ip("link", "add", pair.links[0], "type", "veth", "peer", "name", pair.links[1])
        for space, link, address in zip(pair.spaces, pair.links, pair.addresses):
            ip("link", "set", link, "netns", space)
            ip("-n", space, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", space, "link", "set", link, "up")
        yield pair
    finally:
        for space in pair.spaces:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(
                ["ip", "netns", "del", space], check=False, capture_output=True, timeout=30
            )


def run_pair(pair: Pair, envs: tuple[dict, dict], local_addr: bool) -> list:
    args = ["--nnodes", "2", "--master-addr", pair.addresses[0],
            "--master-port", str(free_port()), "--join-timeout", "30",
            "--nproc-per-node", "1"]  # fmt: skip
    agents = []
    for rank in (0, 1):
        extra = ["--local-addr", pair.addresses[rank]] if local_addr else []
        agents.append(start_agent(rank, args + extra, envs[rank], netns=pair.spaces[rank]))
    return [agent.finish() for agent in agents]


def test_nodes_reach_each_other_over_the_veth_pair(pair):
    envs = ({"GLOO_SOCKET_IFNAME": pair.links[0]}, {"GLOO_SOCKET_IFNAME": pair.links[1]})
    for agent in run_pair(pair, envs, local_addr=True):
        assert agent.code == 0, agent.stderr[-2000:]
        assert confirmed(agent) == []
        nodes = agent.nodes()
        assert pair.addresses[0] in nodes[0]["addresses"]
        assert pair.addresses[1] in nodes[1]["addresses"]
        assert all(n["collectives"]["gloo"]["result"] == "ok" for n in nodes.values())
        evidence = agent.cause("network-interface")["evidence"]
        assert any(f"({pair.addresses[1]}) is reached" in line for line in evidence)


def test_an_interface_the_other_node_cannot_reach_is_named(pair):
    # lo exists on node 1, but 127.0.0.1 there is not node 1 for node 0
    envs = ({"GLOO_SOCKET_IFNAME": pair.links[0]}, {"GLOO_SOCKET_IFNAME": "lo"})
    for agent in run_pair(pair, envs, local_addr=True):
        assert agent.code == 0, agent.stderr[-2000:]
        cause = agent.cause("network-interface")
        assert cause["verdict"] == "confirmed"
        problem = cause["evidence"][0]
        assert problem.startswith("node 1 (") and "GLOO_SOCKET_IFNAME=lo" in problem
        assert "not reachable from node 0" in problem


def test_the_ranks_store_behind_a_host_name_the_other_node_cannot_reach(pair):
    # Without --local-addr torchrun hands the ranks the host name of the node it
    # ranked first for their store, which does not lead into that node's namespace.
    envs = ({"GLOO_SOCKET_IFNAME": pair.links[0]}, {"GLOO_SOCKET_IFNAME": pair.links[1]})
    agents = run_pair(pair, envs, local_addr=False)
    for agent in agents:
        assert agent.code == 0, agent.stderr[-2000:]
        cause = agent.cause("master-endpoint-mismatch")
        assert cause["verdict"] == "confirmed"
        # the node torchrun ranks first serves that store: the other one cannot reach it
        assert cause["evidence"][0].startswith(("node 0 (", "node 1 ("))
        assert "--local-addr" in cause["evidence"][0]
