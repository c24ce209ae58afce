"""`assistant doctor` across nodes: the nodes probe through torchrun's own rendezvous.

Every node runs the doctor with the same arguments as the training job;
each starts one torchrun launch of probes/nodes.py with one process:

    python -m torch.distributed.run --nnodes 1:N --nproc-per-node 1
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ddp-assistant-doctor
        --rdzv-conf join_timeout=T+15,last_call_timeout=T,read_timeout=T+15 probes/nodes.py

`--nnodes 1:N` is what makes a missing node visible: torchrun ends the
rendezvous when all N have joined, or T seconds after the first did (its
last call), and the nodes that came then name the node ranks that did not.
A node that cannot reach the endpoint, or comes after the round closed,
gets torchrun's own error after T seconds. A deadline (T plus the probe's
budget) and the marked process-group kill (processes.py) end anything left.

    plan = NodesPlan.from_options(nnodes=2, node_rank=0, master_addr="node-1",
                                  master_port=29500, join_timeout=60)
    runner = NodesRunner(ProbeRunner(), plan)   # .run(names) as ProbeRunner's
    run = runner.run_nodes()                    # the "nodes" ProbeRun alone

Standard library only (plus assistant.results / errors / config).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from assistant.config import probes_dir
from assistant.errors import UserError
from assistant.probing import processes
from assistant.probing.protocol import (
    EXCHANGE_TIMEOUT_ENV,
    MASTER_ADDR_TOLD_ENV,
    MASTER_PORT_TOLD_ENV,
    NNODES_ENV,
    NODE_RANK_ENV,
    NODES_PROBE,
    NPROC_TOLD_ENV,
    RDZV_ENDPOINT_ENV,
    STORAGE_DIR_ENV,
    NodesFacts,
    new_record,
)
from assistant.probing.records import log_tail
from assistant.probing.runner import ProbeRunner, ProgressEvent, launch_temp
from assistant.results import ProbeRun

DEFAULT_PORT = 29500  # torchrun's default master port
DEFAULT_JOIN_TIMEOUT = 60.0
RDZV_ID = "ddp-assistant-doctor"
# After the rendezvous: interpreter start, facts, three exchange steps and
# the collectives, each bounded inside the probe; this is the outer bound.
AFTER_JOIN_SECONDS = 150.0
# torchrun's start before it joins (interpreter, torch import) on a busy machine.
START_SECONDS = 45.0
EXCHANGE_SECONDS = 20.0
JOIN_MARGIN_SECONDS = 15.0
# Once torchrun holds a connection to the endpoint it is in the rendezvous, and
# its own join timeout (the join timeout plus JOIN_MARGIN_SECONDS) runs; this
# much longer lets it fail in its own words before it is stopped.
RDZV_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.1
ENDPOINT_CHECK_SECONDS = 0.5
# torchrun's rendezvous errors, as its log names them.
RDZV_ERRORS = re.compile(r"(Rendezvous\w*Error|DistStoreError|TimeoutError)[:(].*")


@dataclass(frozen=True)
class NodesPlan:
    """What every node of the job was told: node count, this node's rank, the endpoint."""

    nnodes: int
    node_rank: int
    rdzv_host: str
    rdzv_port: int
    master_addr: str
    master_port: int
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    nproc_per_node: int | None = None  # ranks per node the job uses (None: the runner's)
    source: str = "options"  # "options" | "slurm"
    # torchrun's --local-addr, as the job passes it: the address the first
    # node gives the ranks for their store (default: its host name).
    local_addr: str | None = None
    # The folder whose sharing across the nodes is checked (the job's output or
    # checkpoint folder, as this node sees it); None: no storage check.
    storage_dir: str | None = None

    @property
    def endpoint(self) -> str:
        host = f"[{self.rdzv_host}]" if ":" in self.rdzv_host else self.rdzv_host
        return f"{host}:{self.rdzv_port}"

    @classmethod
    def from_options(
        cls,
        nnodes: int | None,
        node_rank: int | None,
        master_addr: str | None = None,
        master_port: int | None = None,
        rdzv_endpoint: str | None = None,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        nproc_per_node: int | None = None,
        source: str = "options",
        local_addr: str | None = None,
    ) -> NodesPlan:
        """The plan from doctor's options; a UserError names what is missing or wrong."""
        if nnodes is None or nnodes < 1:
            raise UserError("--nnodes must be a positive number of nodes")
        if node_rank is None:
            raise UserError("--node-rank is needed with --nnodes (0 to nnodes-1)")
        if not 0 <= node_rank < nnodes:
            raise UserError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
        if join_timeout <= 0:
            raise UserError("--join-timeout must be a positive number of seconds")
        if rdzv_endpoint:
            host, port = parse_endpoint(rdzv_endpoint)
        elif master_addr:
            host, port = master_addr, master_port or DEFAULT_PORT
        else:
            raise UserError("give --master-addr (and --master-port) or --rdzv-endpoint HOST:PORT")
        if not 0 < port < 65536:
            raise UserError(f"port {port} is not a TCP port")
        return cls(
            nnodes=nnodes,
            node_rank=node_rank,
            rdzv_host=host,
            rdzv_port=port,
            master_addr=master_addr or host,
            master_port=master_port or port,
            join_timeout=float(join_timeout),
            nproc_per_node=nproc_per_node,
            source=source,
            local_addr=local_addr,
        )

    @classmethod
    def from_slurm(
        cls,
        env: Mapping[str, str],
        master_addr: str | None = None,
        master_port: int | None = None,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        nproc_per_node: int | None = None,
    ) -> NodesPlan:
        """The plan from srun's SLURM_* variables (one doctor per node).

        The master is --master-addr, else MASTER_ADDR, else the first host
        of the job's node list, as Slurm launch scripts usually pick it.
        """
        nnodes = _int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"))
        node_rank = _int(env.get("SLURM_NODEID"))
        if nnodes is None or node_rank is None:
            raise UserError(
                "--slurm needs SLURM_NNODES and SLURM_NODEID: run it under srun, "
                "e.g. srun --ntasks-per-node=1 assistant doctor --slurm"
            )
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = master_addr or env.get("MASTER_ADDR") or first_host(nodelist)
        if not addr:
            raise UserError("--slurm found no node list (SLURM_JOB_NODELIST) and no MASTER_ADDR")
        port = master_port or _int(env.get("MASTER_PORT")) or DEFAULT_PORT
        return cls.from_options(
            nnodes, node_rank, addr, port, None, join_timeout, nproc_per_node, source="slurm"
        )


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); no port means torchrun's 29500."""
    match = re.fullmatch(
        r"\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?|(?P<host>[^:\s]+)(?::(?P<port>\d+))?", text.strip()
    )
    if not match:
        raise UserError(f"--rdzv-endpoint {text!r} is not HOST:PORT")
    host = match.group("v6") or match.group("host")
    port = match.group("p6") or match.group("port")
    return host, int(port) if port else DEFAULT_PORT


def first_host(nodelist: str) -> str | None:
    """The first host of a Slurm node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    first = re.match(r"\s*([^,\[]*)(\[([^\]]*)\])?([^,]*)", nodelist)
    if not first or not (first.group(1) or first.group(3)):
        return None
    prefix, ranges, suffix = first.group(1), first.group(3), first.group(4)
    if ranges is None:
        return prefix + suffix
    start = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{start}{suffix}"


class NodesRunner:
    """Runs the nodes probe across the job's nodes, then this node's own probes.

    Has ProbeRunner's run(names, on_progress, cancel), so Pipeline.doctor
    uses it unchanged: the runs it returns are this node's probes plus one
    "nodes" run whose record holds every node's facts. local=False runs
    only the nodes probe.
    """

    def __init__(self, runner: ProbeRunner, plan: NodesPlan, local: bool = True):
        self.runner = runner
        self.plan = plan
        self.local = local

    def run(
        self,
        names: list[str],
        on_progress: Callable[[ProgressEvent], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[ProbeRun]:
        nodes = self.run_nodes(on_progress, cancel)
        stopped = (cancel is not None and cancel.is_set()) or processes.stop_requested()
        if not self.local or stopped:
            return [nodes]
        # This node's rendezvous probe checks the master the job was told,
        # unless the person exported one of their own.
        told = {"MASTER_ADDR": self.plan.master_addr, "MASTER_PORT": str(self.plan.master_port)}
        for key, value in told.items():
            if key not in self.runner.env and key not in os.environ:
                self.runner.env[key] = value
        return self.runner.run(names, on_progress, cancel) + [nodes]

    def run_nodes(
        self,
        on_progress: Callable[[ProgressEvent], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> ProbeRun:
        """One torchrun launch of probes/nodes.py on this node; its outcome as a ProbeRun."""
        began = time.monotonic()
        _report(on_progress, ProgressEvent(NODES_PROBE, "started", 0.0))
        with processes.tracked_folder("ddp-nodes-") as workdir:
            run = self._launch(workdir, cancel)
        _report(
            on_progress,
            ProgressEvent(NODES_PROBE, "finished", time.monotonic() - began, run.status),
        )
        return run

    def _launch(self, workdir: Path, cancel: threading.Event | None) -> ProbeRun:
        facts_dir = workdir / "facts"
        facts_dir.mkdir()
        log_path = workdir / "launch.log"
        busy = endpoint_busy(self.plan)  # before our own store could take it
        started = time.monotonic()
        with open(log_path, "wb") as log:
            try:
                launch = processes.start_marked(
                    self.command(workdir / "torchelastic"),
                    env=self.environment(facts_dir, launch_temp(workdir)),
                    cwd=workdir,
                    stdout=log,
                    stderr=log,
                )
            except OSError as exc:
                return ProbeRun(NODES_PROBE, "error", 0.0, [], f"cannot start torchrun: {exc}")
            try:
                ending = self._wait(launch, started, cancel, facts_dir)
            finally:
                launch.stop()
        seconds = time.monotonic() - started
        tail = log_tail(log_path)
        record = _record(facts_dir)
        if record is None and ending != "cancelled":  # never got through the rendezvous
            record = join_record(self.plan, join_failure(tail, self.plan, ending), busy)
        return nodes_run(ending, record, tail, seconds, self.plan)

    def _wait(self, launch, started: float, cancel, facts_dir: Path) -> str:
        """ "exit", "timeout" or "cancelled": how the launch ended.

        Two deadlines: the rendezvous (the join timeout, torchrun's margin
        and its start) until the probe's first record appears, then the
        probe's own AFTER_JOIN_SECONDS. A stranger on the endpoint's port
        can hold torchrun in its store handshake far longer than that. The
        start allowance ends once torchrun is connected to the endpoint: from
        then on it waits for the rendezvous alone (plus RDZV_GRACE_SECONDS).
        """
        deadline = started + self.plan.join_timeout + JOIN_MARGIN_SECONDS + START_SECONDS
        joined = in_rendezvous = False
        next_check = started
        while launch.poll() is None:
            if (cancel is not None and cancel.is_set()) or processes.stop_requested():
                return "cancelled"
            now = time.monotonic()
            if not joined and any(facts_dir.glob(f"{NODES_PROBE}.rank*.json")):
                joined, deadline = True, now + AFTER_JOIN_SECONDS
            elif not joined and not in_rendezvous and now >= next_check:
                # The start allowance is for a slow interpreter; once torchrun is
                # connected to the endpoint only the rendezvous is left to wait for
                # (a stranger on the port would otherwise hold it to the full bound).
                next_check = now + ENDPOINT_CHECK_SECONDS
                if connected_to_port(launch.pid, self.plan.rdzv_port):
                    in_rendezvous = True
                    rendezvous_end = now + self.plan.join_timeout + JOIN_MARGIN_SECONDS
                    deadline = min(deadline, rendezvous_end + RDZV_GRACE_SECONDS)
            if now > deadline:
                return "timeout"
            time.sleep(POLL_SECONDS)
        return "exit"

    def command(self, log_dir: Path) -> list[str]:
        """The torchrun line: one process, the c10d rendezvous, elastic 1..N nodes."""
        # last_call_timeout is the join timeout proper: how long the first node
        # waits for the rest. join_timeout must outlast it, or torchrun fails
        # the lone node instead of starting it with the nodes that came.
        last_call = f"{self.plan.join_timeout:g}"
        join = f"{self.plan.join_timeout + JOIN_MARGIN_SECONDS:g}"
        return [
            self.runner.python,
            "-m",
            "torch.distributed.run",
            f"--nnodes=1:{self.plan.nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.plan.endpoint}",
            f"--rdzv-id={RDZV_ID}",
            f"--rdzv-conf=join_timeout={join},last_call_timeout={last_call},read_timeout={join}"
            + (",is_host=true" if hosts_endpoint(self.plan.rdzv_host) else ""),
            "--max-restarts=0",
            f"--log-dir={log_dir}",
            *([f"--local-addr={self.plan.local_addr}"] if self.plan.local_addr else []),
            str(probes_dir() / f"{NODES_PROBE}.py"),
        ]

    def environment(self, facts_dir: Path, temp: Path) -> dict[str, str]:
        """The probes' environment (TMPDIR `temp`) plus what this node was told."""
        env = self.runner.probe_env(facts_dir, temp)
        env.update(
            {
                NODE_RANK_ENV: str(self.plan.node_rank),
                NNODES_ENV: str(self.plan.nnodes),
                NPROC_TOLD_ENV: str(self.plan.nproc_per_node or self.runner.nproc_per_node),
                MASTER_ADDR_TOLD_ENV: self.plan.master_addr,
                MASTER_PORT_TOLD_ENV: str(self.plan.master_port),
                RDZV_ENDPOINT_ENV: self.plan.endpoint,
                EXCHANGE_TIMEOUT_ENV: f"{EXCHANGE_SECONDS:g}",
            }
        )
        if self.plan.storage_dir:
            env[STORAGE_DIR_ENV] = self.plan.storage_dir
        return env


def nodes_run(
    ending: str, record: dict | None, tail: list[str], seconds: float, plan: NodesPlan
) -> ProbeRun:
    """The launch's outcome as the "nodes" ProbeRun (pure: tests feed it recorded pieces)."""
    ranks = [record] if record else []
    if record and record.get("status") in ("ok", "failed"):
        detail = "; ".join(record.get("problems") or []) or record.get("summary") or ""
        return ProbeRun(NODES_PROBE, record["status"], seconds, ranks, detail)
    if ending == "cancelled":
        return ProbeRun(NODES_PROBE, "interrupted", seconds, ranks, "stopped")
    if ending == "timeout":
        detail = (record or {}).get("reason") or f"no answer within {seconds:.0f} s"
        return ProbeRun(NODES_PROBE, "timeout", seconds, ranks, detail)
    if record and (record.get("facts") or {}).get("join_error"):
        return ProbeRun(NODES_PROBE, "error", seconds, ranks, record["facts"]["join_error"])
    if record:  # the probe started (so the node joined) but ended without its answer
        reason = record.get("reason") or (tail[-1] if tail else "")
        detail = f"the nodes probe ended while {record.get('status')}: {reason}"[:400]
        return ProbeRun(NODES_PROBE, "error", seconds, ranks, detail)
    return ProbeRun(NODES_PROBE, "error", seconds, ranks, join_failure(tail, plan))


def join_record(plan: NodesPlan, reason: str, busy: bool | None) -> dict:
    """The runner's record for a node that never got through the rendezvous.

    Written by the runner (the protocol's record, as for a rank that wrote
    none): what this node was told, why it could not join, and whether the
    endpoint's port on this node was taken before the doctor started.
    """
    facts = NodesFacts(
        node_rank=plan.node_rank,
        expected_nnodes=plan.nnodes,
        rendezvous=plan.endpoint,
        join_error=reason,
        endpoint_busy_before=busy,
    )
    return new_record(
        NODES_PROBE, "error", rank=plan.node_rank, reason=reason, facts=facts.to_dict()
    )


def endpoint_busy(plan: NodesPlan) -> bool | None:
    """Whether the endpoint's port is taken on this node (None: the endpoint is elsewhere).

    Bound with SO_REUSEADDR as TCPStore binds, so only a live listener counts.
    """
    here = plan.rdzv_host == "localhost" or _loopback(plan.rdzv_host)
    if not here and not hosts_endpoint(plan.rdzv_host):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", plan.rdzv_port))
        except OSError:
            return True
    return False


def connected_to_port(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to `port` (Linux /proc;
    False where it cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # no /proc, the process is gone, or it is not ours
        return False
    inodes = {
        link[8:-1] for link in (_fd_target(pid, fd) for fd in fds) if link.startswith("socket:[")
    }
    wanted = f":{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            fields = row.split()
            established = len(fields) > 9 and fields[3] == "01"
            if established and fields[2].endswith(wanted) and fields[9] in inodes:
                return True
    return False


def _fd_target(pid: int, fd: str) -> str:
    """What a process's open file descriptor points at ("" once it is closed)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hosts_endpoint(host: str) -> bool:
    """Whether the endpoint is an address of this node other than loopback.

    torchrun decides who serves the rendezvous store by comparing the
    endpoint with this host's name; an address on a second interface (or in
    a network namespace) does not match it, and then no node serves the
    store. Loopback is left to torchrun: two agents on one machine must
    settle it between them (the second falls back to a client), which
    is_host=true would forbid.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        if ipaddress.ip_address(address[0]).is_loopback:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))  # only an address of this host can be bound
            except OSError:
                continue
            return True
    return False


def join_failure(tail: list[str], plan: NodesPlan, ending: str = "exit") -> str:
    """Why torchrun ended before the probe wrote anything, in one line."""
    found = next((m.group(0) for line in reversed(tail) if (m := RDZV_ERRORS.search(line))), None)
    if found is None and ending == "timeout":
        found = "torchrun was still waiting in the rendezvous; it was stopped"
    reason = found or (tail[-1] if tail else "torchrun ended without output")
    return (
        f"node {plan.node_rank} could not join the rendezvous at {plan.endpoint} "
        f"within {plan.join_timeout:g} s: {reason[:300]}"
    )


def _record(facts_dir: Path) -> dict | None:
    """This node's nodes-probe record (one process per node, so one file)."""
    for path in sorted(facts_dir.glob(f"{NODES_PROBE}.rank*.json")):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return None


def _report(callback, event: ProgressEvent) -> None:
    if callback is not None:
        callback(event)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def plan_from_options(
    env: Mapping[str, str],
    *,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    slurm: bool = False,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    nproc_per_node: int | None = None,
    local_addr: str | None = None,
    storage_dir: str | None = None,
) -> NodesPlan | None:
    """doctor's options -> a NodesPlan, or None for the single-machine doctor."""
    if slurm:
        if nnodes is not None or node_rank is not None or rdzv_endpoint:
            raise UserError(
                "--slurm reads the node count and rank from SLURM_*: drop --nnodes, --node-rank and --rdzv-endpoint"
            )
        plan = NodesPlan.from_slurm(env, master_addr, master_port, join_timeout, nproc_per_node)
        return replace(plan, local_addr=local_addr, storage_dir=storage_folder(storage_dir))
    if nnodes is None:
        given = [
            name
            for name, value in (
                ("--node-rank", node_rank),
                ("--master-addr", master_addr),
                ("--master-port", master_port),
                ("--rdzv-endpoint", rdzv_endpoint),
            )
            if value is not None
        ]
        if given:
            raise UserError(f"{', '.join(given)} need --nnodes (or --slurm)")
        return None
    plan = NodesPlan.from_options(
        nnodes,
        node_rank,
        master_addr,
        master_port,
        rdzv_endpoint,
        join_timeout,
        nproc_per_node,
        local_addr=local_addr,
    )
    return replace(plan, storage_dir=storage_folder(storage_dir))


def storage_folder(given: str | None) -> str | None:
    """The folder to check for sharing, absolute: --storage-dir, or the current folder
    (where relative output and checkpoint paths land). A UserError when it is no folder."""
    folder = Path(given) if given else Path.cwd()
    if not folder.is_dir():
        raise UserError(f"--storage-dir {given}: no such folder on this node")
    return str(folder.resolve())
