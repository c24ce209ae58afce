"""Do the nodes of a multi-node job agree, and can they reach each other?

Run on every node with the same arguments (standard library and torch only;
copy the probes/ folder to each node), one process per node:

    PROBE_NNODES=2 PROBE_NODE_RANK=0 PROBE_RDZV_ENDPOINT=node-1:29500 \\
    python -m torch.distributed.run --nnodes 1:2 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint node-1:29500 \\
        --rdzv-conf join_timeout=75,last_call_timeout=60 probes/nodes.py

torchrun's c10d rendezvous gathers the nodes (`--nnodes 1:N`: it ends
after last_call_timeout with whoever came; join_timeout must be longer),
so a node that never joins is named by the others instead of hanging them. Each node then writes its
facts (host name and what it resolves to, interfaces, the interface
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME select, torch / CUDA / NCCL / driver
versions, what it was told: nnodes, nproc per node, the master endpoint)
into the rendezvous store, reads everyone's, tries a TCP connection to
every address of every other node, and runs a cross-node all_reduce on gloo
(and NCCL where every node has a GPU), timing its bandwidth. Every node
ends with every node's facts. With PROBE_STORAGE_DIR each node also writes a
small marker file into that folder (the job's output or checkpoint folder),
looks for every other node's marker there, and removes its own at the end:
a folder on each machine's own disk shows only its own marker.

The exchange goes through the rendezvous store itself, not a process
group: a node whose GLOO_SOCKET_IFNAME names no interface cannot create a
gloo group, but its facts still reach the others.

If it hangs: a node joined the rendezvous and then stopped answering; each
exchange step waits at most PROBE_EXCHANGE_TIMEOUT seconds (default 20),
and the collectives run with a short process-group timeout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import versions
from _probekit import (
    connect,
    cuda_status,
    env_int,
    interfaces,
    is_loopback,
    main,
    one_line,
    resolve,
    user_env,
)
from probe_protocol import (
    DEFAULT_EXCHANGE_TIMEOUT,
    EXCHANGE_TIMEOUT_ENV,
    MASTER_ADDR_TOLD_ENV,
    MASTER_PORT_TOLD_ENV,
    NNODES_ENV,
    NODE_RANK_ENV,
    NODES_KEY_PREFIX,
    NODES_PROBE,
    NPROC_TOLD_ENV,
    RDZV_ENDPOINT_ENV,
    STORAGE_DIR_ENV,
    STORAGE_MARKER_PREFIX,
)
from system import gloo_interfaces, nccl_interfaces

NAME = NODES_PROBE
CONNECT_SECONDS = 2.0  # one TCP connection attempt to a peer address
COLLECTIVE_TIMEOUT = timedelta(seconds=20)
COLLECTIVE_ELEMENTS = 1 << 20  # 4 MiB of float32 per all_reduce
TIMED_ROUNDS = 3
POLL_SECONDS = 0.1


def collect(ctx) -> dict:
    """Every node's facts, gathered through the rendezvous store."""
    told_nnodes = env_int(NNODES_ENV)
    group_rank = env_int("GROUP_RANK") or 0
    joined = env_int("GROUP_WORLD_SIZE") or 1
    exchange = Exchange(_rendezvous_store(), group_rank, joined, _exchange_timeout())
    listener = Listener()
    me = this_node(ctx, group_rank, listener.port)
    marker = storage_marker(group_rank)
    me["storage"] = write_marker(marker)  # before the facts go out: peers look for it next
    try:
        facts, nodes = _exchange_all(ctx, exchange, me, group_rank, told_nnodes, joined)
    finally:
        remove_marker(marker)  # also when the exchange fails: nothing left in the user's folder
        listener.close()
    facts["nodes"] = _ordered(nodes)
    facts["silent"] = sorted(set(range(joined)) - set(nodes))
    facts["missing"] = missing_node_ranks(told_nnodes, facts["nodes"])
    facts["problems"] = _problems(facts)
    facts["summary"] = _summary(facts)
    return facts


def _exchange_all(ctx, exchange, me: dict, group_rank: int, told_nnodes, joined: int):
    """The exchange steps: facts, reachability, storage markers, collectives."""
    facts = {
        "node_rank": me["node_rank"],
        "expected_nnodes": told_nnodes,
        "group_world_size": joined,
        "rendezvous": os.environ.get(RDZV_ENDPOINT_ENV),
    }
    ctx.checkpoint({**facts, "nodes": [me]})
    nodes = exchange.share("facts", me)
    me["reach"] = reach_peers(me, nodes)
    for rank, reach in exchange.share("reach", me["reach"]).items():
        nodes[rank]["reach"] = reach
    if me["storage"]:
        me["storage"]["sees"] = markers_seen(me, nodes)
    for rank, storage in exchange.share("storage", me["storage"]).items():
        nodes[rank]["storage"] = storage
    ctx.checkpoint({**facts, "nodes": _ordered(nodes)})
    collectives = run_collectives(group_rank, nodes, joined)
    for rank, result in exchange.share("collectives", collectives).items():
        nodes[rank].update(result)
    exchange.share("done", True)  # nobody leaves while another still reads the store
    return facts, nodes


# --- this node ---------------------------------------------------------------


def this_node(ctx, group_rank: int, listen_port: int) -> dict:
    """This node's own facts, before anything is exchanged."""
    nics = interfaces()
    hostname = socket.gethostname()
    lookup = resolve(hostname)
    env = {
        name: os.environ[name]
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        if os.environ.get(name)
    }
    told = {
        "nnodes": env_int(NNODES_ENV),
        "nproc_per_node": env_int(NPROC_TOLD_ENV),
        "world_size": _int_or_none(user_env("WORLD_SIZE")),
        "master_addr": os.environ.get(MASTER_ADDR_TOLD_ENV),
        "master_port": env_int(MASTER_PORT_TOLD_ENV),
    }
    version_facts = versions.collect(ctx)
    return {
        # Not told (a bare torchrun start): the rendezvous's order stands in.
        "node_rank": env_int(NODE_RANK_ENV, group_rank),
        "group_rank": group_rank,
        "hostname": hostname,
        "network_id": network_id(),
        "hostname_addresses": lookup["addresses"],
        "hostname_error": lookup["error"],
        "hostname_loopback": bool(lookup["addresses"])
        and all(is_loopback(a) for a in lookup["addresses"]),
        "interfaces": [{k: nic[k] for k in ("name", "up", "loopback", "ipv4")} for nic in nics],
        "env": env,
        "gloo_selected": gloo_interfaces(env.get("GLOO_SOCKET_IFNAME"), nics),
        "nccl_selected": nccl_interfaces(env.get("NCCL_SOCKET_IFNAME"), nics),
        "versions": {
            key: version_facts.get(key)
            for key in ("torch", "torch_cuda", "nccl", "driver", "driver_cuda", "python")
        },
        "gpus": cuda_status()["device_count"],
        "told": told,
        "master": master_check(told["master_addr"], told["master_port"]),
        "worker_store": _worker_store(),
        "listen_port": listen_port,
    }


def network_id() -> str | None:
    """Boot id and network namespace: equal on nodes that share one network stack."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}/{namespace}"


def master_check(addr: str | None, port: int | None) -> dict:
    """Whether the master endpoint this node was told resolves here and answers."""
    if not addr:
        return {}
    lookup = resolve(addr)
    result = {
        "addr": addr,
        "port": port,
        "resolved": lookup["addresses"],
        "resolve_error": lookup["error"],
        "loopback": bool(lookup["addresses"]) and all(is_loopback(a) for a in lookup["addresses"]),
    }
    if port and not lookup["error"]:
        result["connect"] = connect(addr, port, CONNECT_SECONDS)
    return result


def _worker_store() -> dict:
    """The store torchrun gave the workers (MASTER_ADDR:MASTER_PORT): env:// needs it."""
    addr, port = os.environ.get("MASTER_ADDR"), env_int("MASTER_PORT")
    if not addr or not port:
        return {}
    return {"addr": addr, "port": port, "connect": connect(addr, port, CONNECT_SECONDS)}


# --- the exchange --------------------------------------------------------------


def _rendezvous_store():
    """A client of the c10d rendezvous store every joined node has reached already.

    Started by hand without PROBE_RDZV_ENDPOINT: the ranks' own store
    (MASTER_ADDR:MASTER_PORT), which serves when every node reaches it.
    """
    import torch.distributed as dist

    ranks_store = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    endpoint = os.environ.get(RDZV_ENDPOINT_ENV) or ranks_store
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"{RDZV_ENDPOINT_ENV}={endpoint!r} is not HOST:PORT")
    return dist.TCPStore(
        host.strip("[]"), int(port), None, False, timedelta(seconds=_exchange_timeout())
    )


class Exchange:
    """All-gather of JSON values through a store, tolerant of nodes that went quiet."""

    def __init__(self, store, group_rank: int, joined: int, timeout: float):
        self.store = store
        self.group_rank = group_rank
        self.joined = joined
        self.timeout = timeout
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"{NODES_KEY_PREFIX}/{run}/{restart}"

    def share(self, step: str, value) -> dict:
        """{group rank: value} of every node that shared this step within the timeout."""
        self.store.set(self._key(step, self.group_rank), json.dumps(value, default=str))
        deadline = time.monotonic() + self.timeout
        pending = set(range(self.joined))
        found: dict = {}
        while pending:
            for rank in sorted(pending):
                key = self._key(step, rank)
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
                    pending.discard(rank)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(POLL_SECONDS)
        return found

    def _key(self, step: str, rank: int) -> str:
        return f"{self.prefix}/{step}/{rank}"


# --- reachability ---------------------------------------------------------------


class Listener:
    """A TCP port that accepts and closes connections, so peers can test reaching us."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        self.sock.close()


def peer_addresses(peer: dict) -> list[str]:
    """Every IPv4 address a peer might be reached at: interfaces and its host name."""
    found = [nic["ipv4"] for nic in peer.get("interfaces") or [] if nic.get("ipv4")]
    found += [a for a in peer.get("hostname_addresses") or [] if ":" not in a]
    return list(dict.fromkeys(found))


def reach_peers(me: dict, nodes: dict) -> dict:
    """{peer group rank: {address: connect result}} for every other node."""
    jobs = []
    for rank, peer in nodes.items():
        if rank == me["group_rank"] or not peer.get("listen_port"):
            continue
        for address in peer_addresses(peer):
            jobs.append((str(rank), address, peer["listen_port"]))
    results: dict = {}
    threads = []

    def attempt(rank: str, address: str, port: int) -> None:
        results.setdefault(rank, {})[address] = connect(address, port, CONNECT_SECONDS)

    for job in jobs:
        thread = threading.Thread(target=attempt, args=job, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(CONNECT_SECONDS + 1)
    return results


# --- shared storage ----------------------------------------------------------------


def storage_marker(group_rank: int, run: str | None = None) -> Path | None:
    """This node's marker in the folder to check (None when no folder was given).

    Named by the rendezvous run and the node's group rank, so every node knows
    the others' names and an earlier run's leftovers are never mistaken for them."""
    folder = os.environ.get(STORAGE_DIR_ENV)
    if not folder:
        return None
    run = run or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:64]
    return Path(folder) / f"{STORAGE_MARKER_PREFIX}-{safe}-{group_rank}"


def write_marker(marker: Path | None) -> dict:
    """{"dir", "wrote", "error"}: the marker written and closed (visible to NFS peers)."""
    if marker is None:
        return {}
    try:
        with open(marker, "x", encoding="utf-8") as out:
            out.write(f"{socket.gethostname()} {os.getpid()}\n")
    except OSError as exc:
        return {"dir": str(marker.parent), "wrote": False, "error": one_line(exc)}
    return {"dir": str(marker.parent), "wrote": True, "error": None}


def markers_seen(me: dict, nodes: dict) -> dict:
    """{peer group rank: whether its marker is in this node's folder} for each peer that
    wrote one. Only names are looked up: nothing of the folder is listed or read."""
    own = me.get("storage") or {}
    if not own.get("dir"):
        return {}
    seen = {}
    for rank, peer in nodes.items():
        if rank == me["group_rank"] or not (peer.get("storage") or {}).get("wrote"):
            continue
        marker = storage_marker(int(rank))
        seen[str(rank)] = marker is not None and marker.exists()
    return seen


def remove_marker(marker: Path | None) -> None:
    if marker is None:
        return
    try:
        marker.unlink()
    except OSError:
        pass  # never written, or the folder went away: nothing of the user's is touched


# --- collectives -----------------------------------------------------------------


def run_collectives(group_rank: int, nodes: dict, joined: int) -> dict:
    """gloo, then NCCL, all_reduce across the nodes, when every node can take part."""
    blocker = _gloo_blocker(nodes, joined)
    if blocker:
        skipped = {"result": "skipped", "reason": blocker}
        return {"gloo": skipped, "nccl": skipped}
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        failed = {"result": "failed", "error": one_line(exc)}
        return {"gloo": failed, "nccl": {"result": "skipped", "reason": "gloo failed first"}}
    try:
        gloo = timed_all_reduce("cpu", None)
        nccl = _nccl(nodes)
    finally:
        dist.destroy_process_group()
    return {"gloo": gloo, "nccl": nccl}


def _gloo_blocker(nodes: dict, joined: int) -> str | None:
    """Why a cross-node process group cannot be tried, or None."""
    if len(nodes) < joined:
        return "not every node that joined shared its facts"
    if joined < 2:
        return "only this node joined"
    for node in nodes.values():
        who = f"node {node.get('node_rank', node['group_rank'])}"
        value = (node.get("env") or {}).get("GLOO_SOCKET_IFNAME")
        if value and not node.get("gloo_selected"):
            return f"{who}: GLOO_SOCKET_IFNAME={value} names no interface there"
        store = node.get("worker_store") or {}
        if store and store.get("connect") != "ok":
            return f"{who} cannot reach the job's store {store['addr']}:{store['port']}"
    return None


def _nccl(nodes: dict) -> dict:
    import torch.distributed as dist

    without = [str(n.get("node_rank", n["group_rank"])) for n in nodes.values() if not n["gpus"]]
    if without:
        return {"result": "skipped", "reason": f"no GPU on node {', '.join(without)}"}
    if not dist.is_nccl_available():
        return {"result": "skipped", "reason": "this torch has no NCCL"}
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    try:
        group = dist.new_group(backend="nccl", timeout=COLLECTIVE_TIMEOUT)
        return timed_all_reduce(f"cuda:{local}", group)
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        return {"result": "failed", "error": one_line(exc)}


def timed_all_reduce(device: str, group) -> dict:
    """One warm-up and TIMED_ROUNDS timed all_reduce of ones; checks the sum."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    tensor = torch.ones(COLLECTIVE_ELEMENTS, dtype=torch.float32, device=device)
    try:
        dist.all_reduce(tensor, group=group)
        _sync(device)
        started = time.monotonic()
        for _ in range(TIMED_ROUNDS):
            tensor.fill_(1.0)
            dist.all_reduce(tensor, group=group)
        _sync(device)
        seconds = max(time.monotonic() - started, 1e-9)
    except Exception as exc:  # noqa: BLE001 - the failure is the fact this probe reports
        return {"result": "failed", "error": one_line(exc)}
    ok = bool(torch.all(tensor == float(world)).item())
    megabytes = tensor.numel() * tensor.element_size() / 1e6
    return {
        "result": "ok" if ok else "wrong_result",
        "seconds": round(seconds / TIMED_ROUNDS, 4),
        "megabytes": round(megabytes, 2),
        "gbps": round(megabytes * TIMED_ROUNDS / 1e3 / seconds, 3),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# --- the outcome -----------------------------------------------------------------


def missing_node_ranks(told_nnodes: int | None, nodes: list[dict]) -> list[int]:
    """Node ranks the job was told about that no node reported."""
    if not told_nnodes:
        return []
    seen = {node.get("node_rank") for node in nodes}
    return [rank for rank in range(told_nnodes) if rank not in seen]


def _problems(facts: dict) -> list[str]:
    problems = []
    if facts["missing"]:
        problems.append(
            f"node rank(s) {', '.join(map(str, facts['missing']))} never joined the rendezvous"
        )
    if facts["silent"]:
        problems.append(
            f"group rank(s) {', '.join(map(str, facts['silent']))} joined but sent no facts"
        )
    return problems


def _summary(facts: dict) -> str:
    hosts = ", ".join(f"{n.get('node_rank')}={n.get('hostname')}" for n in facts["nodes"])
    return f"{len(facts['nodes'])} of {facts['expected_nnodes'] or '?'} nodes: {hosts}"


def _ordered(nodes: dict) -> list[dict]:
    return [nodes[rank] for rank in sorted(nodes)]


def _exchange_timeout() -> float:
    try:
        return float(os.environ.get(EXCHANGE_TIMEOUT_ENV, DEFAULT_EXCHANGE_TIMEOUT))
    except ValueError:
        return DEFAULT_EXCHANGE_TIMEOUT


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
