"""The contract between the assistant's runner and the probes, written once.

Standard library only, and no import of the assistant: this file travels
with the probes/ folder to any node. The probe scripts import it directly;
the assistant loads this very file (assistant/probing/protocol.py), so the
two sides cannot drift apart. What it fixes:

- the environment variables the runner sets and the probes read;
- the per-rank record: its file name, its keys, its FORMAT version;
- the probes, in the order one batch launch runs them, and the
  set_device_order variants that each need a launch of their own;
- how many GPUs there are (one rule for the runner and the devices probe);
- typed facts per probe (DevicesFacts, BackendFacts, ...), read from a
  record's "facts" dict with from_dict, tolerant of older records (missing
  keys get defaults, unknown keys are kept in `extra`);
- how set_device_order's variant records are read (variant_outcomes).

Record format (FORMAT 1), one JSON file `<probe>.rank<R>.json` per probe and
rank, first written with status "running" and rewritten at checkpoints:

    {"probe": "devices", "format": 1, "status": "ok", "reason": "",
     "summary": "...", "problems": [], "seconds": 0.12,
     "rank": 0, "local_rank": 0, "world_size": 2, "local_world_size": 2,
     "host": "node-1", "pid": 4242, "variant": null, "facts": {...}}
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field, fields
from pathlib import Path

FORMAT = 1

# --- environment variables -----------------------------------------------------

FACTS_DIR_ENV = "PROBE_FACTS_DIR"  # folder the ranks write their records into
VARIANT_ENV = "PROBE_VARIANT"  # which set_device_order variant this launch runs
# "1" when the assistant's runner started the launch; by hand the probes see
# the user's own launch.
RUNNER_ENV = "PROBE_RUNNER"
NPROC_SOURCE_ENV = "PROBE_NPROC_SOURCE"  # "user" (--nproc-per-node given) | "default"
# The runner launches on a free port of its own; the user's values of the
# launcher variables reach the probes as PROBE_USER_<NAME>.
USER_PREFIX = "PROBE_USER_"
# A short process-group timeout, so a probe fails instead of waiting the
# default 10-30 minutes.
PG_TIMEOUT_ENV = "PROBE_PG_TIMEOUT"
DEFAULT_PG_TIMEOUT = 60.0
# Variables torchrun owns: the user's values must not steer the probe launch.
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "PET_")  # PET_* are torchrun's option defaults

# --- multi-node: what each node was told, handed to probes/nodes.py -------------

# The nodes probe is not part of PROBE_ORDER: it needs every node of a job in
# one c10d rendezvous (`assistant doctor --nnodes N ...`), never the
# single-machine batch launch.
NODES_PROBE = "nodes"
NODE_RANK_ENV = "PROBE_NODE_RANK"  # the node rank this node was given (--node-rank)
NNODES_ENV = "PROBE_NNODES"  # how many nodes this node was told the job has
NPROC_TOLD_ENV = "PROBE_NPROC_PER_NODE"  # ranks per node this node was told
MASTER_ADDR_TOLD_ENV = "PROBE_MASTER_ADDR"  # the job's master endpoint, as told
MASTER_PORT_TOLD_ENV = "PROBE_MASTER_PORT"
RDZV_ENDPOINT_ENV = "PROBE_RDZV_ENDPOINT"  # HOST:PORT of the c10d rendezvous store
# Seconds a node waits for the others' facts at each exchange step.
EXCHANGE_TIMEOUT_ENV = "PROBE_EXCHANGE_TIMEOUT"
DEFAULT_EXCHANGE_TIMEOUT = 20.0
# The keys the nodes exchange their facts under, in the rendezvous store.
NODES_KEY_PREFIX = "ddp-assistant/nodes"
# The folder each node checks is shared with the others (the job's output or
# checkpoint folder as the node sees it): each node writes a marker there and
# looks for the others'. Unset: no storage check.
STORAGE_DIR_ENV = "PROBE_STORAGE_DIR"
STORAGE_MARKER_PREFIX = ".ddp-assistant-storage-check"

# --- the probes -----------------------------------------------------------------

# The order of one batch launch (run_probes.py): probes that touch no process
# group first, so a rendezvous problem cannot hide their facts; backend last
# because it sets the CUDA device.
PROBE_ORDER = (
    "launch_env",
    "devices",
    "versions",
    "system",
    "rendezvous",
    "set_device_order",
    "backend",
)
BATCH_SCRIPT = "run_probes.py"
SET_DEVICE_VARIANTS = ("before-init", "after-init", "no-set-device", "device-id")
# Probes whose variants each get a launch of their own (a failed variant can
# leave NCCL unusable for the rest of its process).
PROBE_VARIANTS = {"set_device_order": SET_DEVICE_VARIANTS}

# Statuses a probe writes, and those only the runner gives (a rank it had to
# stop, or one that never wrote a record).
PROBE_STATUSES = ("running", "ok", "failed", "not_applicable", "error")
RUNNER_STATUSES = ("timeout", "interrupted")
FINAL_STATUSES = PROBE_STATUSES[1:] + RUNNER_STATUSES


# --- records --------------------------------------------------------------------


def record_filename(probe: str, rank: int) -> str:
    return f"{probe}.rank{rank}.json"


def is_record_filename(name: str) -> bool:
    """A finished write: records are written to a hidden temp name, then renamed."""
    return not name.startswith(".") and name.endswith(".json")


def temp_record_filename(probe: str, rank: int, pid: int) -> str:
    return f".{record_filename(probe, rank)}.{pid}.tmp"


def new_record(
    probe: str,
    status: str,
    *,
    rank: int,
    reason: str = "",
    summary: str = "",
    problems: list[str] | None = None,
    seconds: float = 0.0,
    local_rank: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
    host: str | None = None,
    pid: int | None = None,
    variant: str | None = None,
    facts: dict | None = None,
) -> dict:
    """A record as the probes write it (and the runner, for a rank that wrote none)."""
    return {
        "probe": probe,
        "format": FORMAT,
        "status": status,
        "reason": reason,
        "summary": summary,
        "problems": list(problems or []),
        "seconds": seconds,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "local_world_size": local_world_size,
        "host": host,
        "pid": pid,
        "variant": variant,
        "facts": dict(facts or {}),
    }


RECORD_KEYS = tuple(new_record("x", "ok", rank=0))


# --- GPUs -------------------------------------------------------------------------


def physical_gpu_count() -> int | None:
    """NVIDIA GPUs the driver reports, whatever CUDA_VISIBLE_DEVICES hides.

    nvidia-smi -L first: in a container it lists the GPUs given to it,
    where /proc/driver/nvidia/gpus may list the whole host's. No driver
    (neither nvidia-smi nor /proc/driver/nvidia) means 0 GPUs; None only
    when nvidia-smi is there but fails and /proc cannot tell either.
    """
    folder = Path("/proc/driver/nvidia/gpus")
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15, check=False
            )
            if out.returncode == 0:
                return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            pass
        return len(list(folder.iterdir())) if folder.is_dir() else None
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def visible_gpu_count(physical: int | None, cuda_visible_devices: str | None) -> int:
    """GPUs a process sees: the physical ones narrowed by CUDA_VISIBLE_DEVICES.

    CUDA reads the list up to its first invalid entry; UUIDs (GPU-..., MIG-...)
    count as valid. An unknown physical count (None) counts as 0.
    """
    physical = physical or 0
    if cuda_visible_devices is None:
        return physical
    count = 0
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < physical):
            count += 1
        else:
            break
    return min(count, physical)


# --- typed facts --------------------------------------------------------------------


def _one(cls) -> dict:
    """Field metadata: the value is one nested facts object."""
    return {"parse": cls.from_dict}


def _many(cls) -> dict:
    """Field metadata: the value is a list of nested facts objects."""
    return {"parse": lambda items: [cls.from_dict(i) for i in items or []]}


@dataclass
class Facts:
    """Base of the typed facts: from_dict tolerates missing and unknown keys.

    A key a record lacks (an older probe) gets the field's default; a key no
    field names (a newer probe) lands in `extra`, so nothing is lost.
    """

    extra: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: dict | None):
        if isinstance(data, cls):
            return data
        data = data if isinstance(data, dict) else {}
        values, names = {}, set()
        for spec in fields(cls):
            if spec.name == "extra":
                continue
            names.add(spec.name)
            if spec.name in data:
                value = data[spec.name]
                parse = spec.metadata.get("parse")
                values[spec.name] = parse(value) if parse and value is not None else value
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**values, extra=extra)

    def to_dict(self) -> dict:
        """The facts as a plain dict: every field (defaults filled in), then extra."""
        data = {spec.name: _plain(getattr(self, spec.name)) for spec in fields(self)}
        extra = data.pop("extra")
        return {**data, **extra}


def _plain(value):
    if isinstance(value, Facts):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class LaunchEnvFacts(Facts):
    """launch_env: the env:// variables a rank sees."""

    env: dict = field(default_factory=dict)  # RANK, LOCAL_RANK, ... -> value or None
    missing: list = field(default_factory=list)
    torchelastic: bool = False
    local_rank_args: list = field(default_factory=list)
    user_env: dict | None = None  # the user's launcher variables, under the runner
    nproc_source: str | None = None
    multi_node_hints: dict = field(default_factory=dict)
    default_start_method: str | None = None
    python: str | None = None
    python_version: str | None = None
    platform: str | None = None


@dataclass
class GpuInfo(Facts):
    """One visible device."""

    index: int | None = None
    name: str | None = None
    uuid: str | None = None
    capability: str | None = None
    total_mib: int | None = None
    pci_bus_id: str | None = None


@dataclass
class LandedDevice(Facts):
    """Where a tensor on cuda:LOCAL_RANK really went."""

    requested: str | None = None
    index: int | None = None
    uuid: str | None = None
    error: str | None = None
    free_mib: int | None = None
    total_mib: int | None = None


@dataclass
class DefaultDevice(Facts):
    """The current device before any set_device (where a bare .cuda() goes)."""

    index: int | None = None
    uuid: str | None = None


@dataclass
class DevicesFacts(Facts):
    """devices: which physical GPU each rank lands on."""

    cuda_built: bool | None = None
    torch_cuda: str | None = None
    driver_loaded: bool | None = None
    physical_gpus: int | None = None  # see physical_gpu_count
    cuda_visible_devices: str | None = None
    cuda_available: bool = False
    cuda_error: str | None = None
    cuda_warning: str | None = None
    device_count: int = 0
    visible: list[GpuInfo] = field(default_factory=list, metadata=_many(GpuInfo))
    local_rank_device: LandedDevice | None = field(default=None, metadata=_one(LandedDevice))
    default_device: DefaultDevice | None = field(default=None, metadata=_one(DefaultDevice))


@dataclass
class VersionsFacts(Facts):
    """versions: torch, CUDA, NCCL and driver versions."""

    torch: str | None = None
    torch_git: str | None = None
    torch_cuda: str | None = None
    torch_hip: str | None = None
    python: str | None = None
    platform: str | None = None
    nccl: str | None = None
    driver: str | None = None
    driver_cuda: str | None = None
    cuda_available: bool = False
    cuda_error: str | None = None
    cuda_warning: str | None = None
    arch_list: list = field(default_factory=list)
    capabilities: list = field(default_factory=list)
    cudnn: int | str | None = None


@dataclass
class SystemFacts(Facts):
    """system: /dev/shm, limits, memory, interfaces, host name."""

    shm: dict | None = None  # {"path", "total_mib", "free_mib"}
    nofile: dict = field(default_factory=dict)  # {"soft", "hard"}, None = unlimited
    memlock: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    oom: dict = field(default_factory=dict)
    cpu_count: int | None = None
    container: bool | None = None
    interfaces: list = field(default_factory=list)
    hostname: str | None = None
    hostname_addresses: list = field(default_factory=list)
    hostname_error: str | None = None
    hostname_loopback: bool | None = None
    env: dict = field(default_factory=dict)
    nccl_selected: list = field(default_factory=list)
    gloo_selected: list | None = None
    iommu: dict = field(default_factory=dict)
    p2p: dict | None = None


@dataclass
class RendezvousFacts(Facts):
    """rendezvous: the user's MASTER_ADDR/MASTER_PORT checked from this host."""

    master_addr: str | None = None  # as the user set it (None: unset)
    master_port: str | None = None
    addr: str | None = None  # what a launch would use
    port: int | None = None
    resolved: list = field(default_factory=list)
    resolve_error: str | None = None
    resolve_seconds: float | None = None
    loopback: bool | None = None
    local: bool | None = None
    launch_store: dict | None = None  # round trip on the launch's own store
    store: dict | None = None  # round trip on the user's endpoint {"result", "error", ...}
    port_free: bool | None = None
    port_error: str | None = None
    port_holder: dict | None = None
    port_note: str | None = None
    connect: str | None = None


@dataclass
class CollectiveResult(Facts):
    """One backend's all_reduce: ok | wrong_result | failed | skipped | unavailable."""

    result: str | None = None
    error: str | None = None
    reason: str | None = None
    seconds: float | None = None
    elements: int | None = None
    cpu_tensor_error: str | None = None
    step: str | None = None


@dataclass
class BackendFacts(Facts):
    """backend: gloo and NCCL on the same collective."""

    platform: str | None = None
    # {"gloo": bool, "nccl": bool, "mpi": bool, "ucc": bool}
    available: dict = field(default_factory=dict)
    gloo: CollectiveResult | None = field(default=None, metadata=_one(CollectiveResult))
    nccl: CollectiveResult | None = field(default=None, metadata=_one(CollectiveResult))


@dataclass
class VariantFacts(Facts):
    """What one set_device_order variant did on one rank."""

    variant: str | None = None
    cuda_available: bool | None = None
    device_count: int | None = None
    nccl_available: bool | None = None
    steps: list = field(default_factory=list)
    step: str | None = None  # the step reached; "done" when all passed
    failed_step: str | None = None
    error: str | None = None
    tensor_device: int | None = None
    all_reduce_ok: bool | None = None
    object_ok: bool | None = None
    current_device: int | None = None
    current_uuid: str | None = None
    bound_device_id: str | None = None
    context_gpus: list | None = None
    where_error: str | None = None


@dataclass
class VariantRun(Facts):
    """One rank's record of one variant launch, as the runner files it."""

    status: str | None = None
    reason: str | None = None
    problems: list = field(default_factory=list)
    seconds: float | None = None
    pid: int | None = None
    facts: VariantFacts | None = field(default=None, metadata=_one(VariantFacts))


def _variant_runs(value) -> dict:
    # The preflight lists the variant names; after the runner merged the
    # variant launches it is {variant: run record}.
    if not isinstance(value, dict):
        return {}
    return {name: VariantRun.from_dict(run) for name, run in value.items()}


@dataclass
class SetDeviceOrderFacts(Facts):
    """set_device_order: the preflight (CUDA, NCCL) and each variant's run."""

    cuda_available: bool = False
    device_count: int = 0
    nccl_available: bool | None = None
    variants: dict[str, VariantRun] = field(default_factory=dict, metadata={"parse": _variant_runs})


@dataclass
class NodeCollective(Facts):
    """One backend's cross-node all_reduce as one node saw it.

    result: ok | wrong_result | failed | skipped; gbps is the algorithm
    bandwidth (bytes reduced / seconds, in GB/s) of the timed rounds.
    """

    result: str | None = None
    reason: str | None = None
    error: str | None = None
    seconds: float | None = None
    megabytes: float | None = None
    gbps: float | None = None


@dataclass
class NodeFacts(Facts):
    """What one node of a multi-node job reported about itself and its peers."""

    node_rank: int | None = None  # as told (--node-rank); None when not given
    group_rank: int | None = None  # the rank torchrun's rendezvous gave it
    hostname: str | None = None
    # boot id + network namespace: nodes with the same one share a network
    # stack, so loopback between them works (two agents on one machine).
    network_id: str | None = None
    hostname_addresses: list = field(default_factory=list)
    hostname_error: str | None = None
    hostname_loopback: bool | None = None
    interfaces: list = field(default_factory=list)  # as _probekit.interfaces()
    env: dict = field(default_factory=dict)  # GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME
    gloo_selected: list | None = None
    nccl_selected: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)  # torch, torch_cuda, nccl, driver, ...
    gpus: int = 0
    told: dict = field(default_factory=dict)  # nnodes, nproc_per_node, world_size, master_*
    master: dict = field(default_factory=dict)  # resolved, resolve_error, loopback, connect
    worker_store: dict = field(default_factory=dict)  # the MASTER_ADDR:PORT torchrun gave
    listen_port: int | None = None
    # peer group rank (as a string) -> {address: "ok" | "refused" | "timeout" | error}
    reach: dict = field(default_factory=dict)
    # The storage check: {"dir", "wrote", "error", "sees": {peer group rank (str): bool}}
    storage: dict = field(default_factory=dict)
    gloo: NodeCollective | None = field(default=None, metadata=_one(NodeCollective))
    nccl: NodeCollective | None = field(default=None, metadata=_one(NodeCollective))


@dataclass
class NodesFacts(Facts):
    """nodes: every node's facts, as each node gathered them over the rendezvous."""

    node_rank: int | None = None  # this node's, as told
    expected_nnodes: int | None = None
    group_world_size: int | None = None  # nodes that completed the rendezvous
    rendezvous: str | None = None  # HOST:PORT
    nodes: list[NodeFacts] = field(default_factory=list, metadata=_many(NodeFacts))
    missing: list = field(default_factory=list)  # node ranks told but never joined
    # group ranks that joined the rendezvous but whose facts never arrived
    silent: list = field(default_factory=list)
    # Written by the runner when this node never got through the rendezvous:
    join_error: str | None = None  # torchrun's reason, in one line
    endpoint_busy_before: bool | None = None  # the endpoint's port here, before the doctor


FACTS_TYPES: dict[str, type[Facts]] = {
    "launch_env": LaunchEnvFacts,
    "devices": DevicesFacts,
    "versions": VersionsFacts,
    "system": SystemFacts,
    "rendezvous": RendezvousFacts,
    "set_device_order": SetDeviceOrderFacts,
    "backend": BackendFacts,
    NODES_PROBE: NodesFacts,
}


@dataclass
class RankRecord:
    """One rank's record of one probe, with its facts typed for that probe."""

    probe: str
    status: str
    rank: int | None = None
    reason: str = ""
    summary: str = ""
    problems: list = field(default_factory=list)
    seconds: float = 0.0
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    host: str | None = None
    pid: int | None = None
    variant: str | None = None
    format: int = FORMAT
    facts: Facts = field(default_factory=Facts)

    @classmethod
    def from_dict(cls, data: dict) -> RankRecord:
        """Read a record dict (any FORMAT so far); facts typed by the probe's name."""
        probe = data.get("probe") or ""
        kind = FACTS_TYPES.get(probe, Facts)
        return cls(
            probe=probe,
            status=data.get("status") or "error",
            rank=data.get("rank"),
            reason=data.get("reason") or "",
            summary=data.get("summary") or "",
            problems=list(data.get("problems") or []),
            seconds=float(data.get("seconds") or 0.0),
            local_rank=data.get("local_rank"),
            world_size=data.get("world_size"),
            local_world_size=data.get("local_world_size"),
            host=data.get("host"),
            pid=data.get("pid"),
            variant=data.get("variant"),
            format=data.get("format", FORMAT),
            facts=kind.from_dict(data.get("facts")),
        )


# --- set_device_order variants ------------------------------------------------------


@dataclass
class VariantOutcome:
    """What one set_device_order variant did across the ranks.

    kind: ok | failed | hang | error | interrupted | not_applicable.
    A rank that failed outranks one that hung: the others usually hang
    waiting for the rank whose error is the reason. works also needs every
    rank to have reached "done" and the ranks of a host not to end on one
    GPU (shared_uuid names it then).
    """

    variant: str
    kind: str
    step: str | None = None
    error: str | None = None
    shared_uuid: str | None = None
    all_done: bool = False

    @property
    def works(self) -> bool:
        return self.kind == "ok" and self.all_done and self.shared_uuid is None

    def describe(self) -> str:
        """The outcome in a few words: ok, failed at init, hang at barrier, error."""
        if self.kind in ("failed", "hang") and self.step:
            return f"{self.kind} at {self.step}"
        return self.kind


def variant_outcome(variant: str, runs: list[tuple[str | None, VariantRun]]) -> VariantOutcome:
    """One variant's outcome from its (host, run) per rank."""
    facts = [run.facts or VariantFacts() for _, run in runs]
    statuses = [run.status for _, run in runs]
    failed = [(run, f) for (_, run), f in zip(runs, facts) if run.status == "failed"]
    step = error = None
    if failed:
        run, first = failed[0]
        kind, step = "failed", first.failed_step or first.step
        error = first.error or run.reason
    elif "error" in statuses:
        kind = "error"
        error = next(run.reason for _, run in runs if run.status == "error")
    elif "timeout" in statuses:
        kind, step = "hang", next((f.step for f in facts if f.step), None)
    elif "interrupted" in statuses:
        kind = "interrupted"
    elif statuses and all(s == "not_applicable" for s in statuses):
        kind = "not_applicable"
    else:
        kind = "ok" if statuses else "interrupted"
    return VariantOutcome(
        variant,
        kind,
        step,
        error,
        _shared_uuid(runs, facts),
        all_done=bool(facts) and all(f.step == "done" for f in facts),
    )


def _shared_uuid(runs, facts) -> str | None:
    """The GPU two ranks of one host both ended on, if they did."""
    by_host: dict = {}
    for (host, _), fact in zip(runs, facts):
        by_host.setdefault(host, []).append(fact.current_uuid)
    for uuids in by_host.values():
        if len(uuids) > 1 and len(set(uuids)) == 1 and uuids[0]:
            return uuids[0]
    return None


def variant_outcomes(ranks: list[dict]) -> dict[str, VariantOutcome]:
    """Per variant, its outcome, from set_device_order's merged rank records."""
    per_variant: dict[str, list] = {}
    for record in ranks:
        facts = SetDeviceOrderFacts.from_dict(record.get("facts"))
        for variant, run in facts.variants.items():
            per_variant.setdefault(variant, []).append((record.get("host"), run))
    return {variant: variant_outcome(variant, runs) for variant, runs in per_variant.items()}
