"""Are /dev/shm, file limits, memory and network interfaces adequate, and no earlier run alive?

Run by hand (standard library and torch only; copy the probes/ folder):

    torchrun --nproc_per_node=1 probes/system.py

Reports /dev/shm size and free space (containers default to 64 MB), the
open-file and locked-memory limits, host memory, signs of the OOM killer
(the kernel's oom_kill counter and the cgroup's), the network interfaces
and which of them NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME select,
peer-to-peer access between the GPUs, whether an IOMMU translates DMA, and
the workers of earlier distributed runs still alive on this node (they hold
GPU memory, GPUs and ports that the next run needs).

If it hangs: only the peer-to-peer check touches the GPUs; run with
CUDA_VISIBLE_DEVICES= to skip it and see the rest.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

from _probekit import cuda_status, interfaces, is_loopback, main, one_line, resolve

try:
    import resource  # POSIX only
except ImportError:  # Windows
    resource = None

NAME = "system"
MIB = 1024 * 1024
NCCL_VARS = (
    "NCCL_SOCKET_IFNAME",
    "NCCL_SOCKET_FAMILY",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_NET",
    "NCCL_DEBUG",
    "NCCL_BUFFSIZE",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
)


def collect(ctx) -> dict:
    """Host resources and network facts of this rank's node."""
    nics = interfaces()
    hostname = socket.gethostname()
    host_lookup = resolve(hostname)
    facts = {
        "shm": shm_space(),
        "nofile": _limit("RLIMIT_NOFILE"),
        "memlock": _limit("RLIMIT_MEMLOCK"),
        "memory": _memory(),
        "oom": _oom_signs(),
        "cpu_count": os.cpu_count(),
        "container": _in_container(),
        "interfaces": nics,
        "hostname": hostname,
        "hostname_addresses": host_lookup["addresses"],
        "hostname_error": host_lookup["error"],
        "hostname_loopback": bool(host_lookup["addresses"])
        and all(is_loopback(a) for a in host_lookup["addresses"]),
        "env": {
            name: os.environ.get(name) for name in NCCL_VARS if os.environ.get(name) is not None
        },
        "nccl_selected": nccl_interfaces(os.environ.get("NCCL_SOCKET_IFNAME"), nics),
        "gloo_selected": gloo_interfaces(os.environ.get("GLOO_SOCKET_IFNAME"), nics),
        "iommu": _iommu(),
        "stale_workers": stale_workers(),
    }
    ctx.checkpoint(facts)
    facts["p2p"] = _peer_access() if ctx.rank.local_rank == 0 else None
    problems = []
    if os.environ.get("NCCL_SOCKET_IFNAME") and not facts["nccl_selected"]:
        problems.append(
            f"NCCL_SOCKET_IFNAME={os.environ['NCCL_SOCKET_IFNAME']} selects no interface"
        )
    if os.environ.get("GLOO_SOCKET_IFNAME") and not facts["gloo_selected"]:
        problems.append(
            f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} selects no interface"
        )
    facts["problems"] = problems
    shm = facts["shm"]
    facts["summary"] = (
        f"/dev/shm {shm['total_mib']} MiB ({shm['free_mib']} free), nofile {facts['nofile']['soft']}, "
        f"NCCL interfaces {','.join(facts['nccl_selected']) or 'none'}"
        if shm
        else f"no /dev/shm, nofile {facts['nofile']['soft']}"
    )
    return facts


# What a launcher (torchrun, torch.distributed.launch, accelerate, deepspeed)
# puts in each worker's environment: a process that has it and is no rank of
# this launch is a worker of another run.
WORKER_VARIABLES = (b"LOCAL_RANK=", b"TORCHELASTIC_RUN_ID=")
MAX_STALE_SHOWN = 20


def stale_workers(proc: str = "/proc") -> list[dict] | None:
    """Distributed workers on this node that belong to no rank of this launch.

    None where /proc is missing (not Linux). Processes of other users whose
    environment cannot be read are not seen.
    """
    root = Path(proc)
    if not root.is_dir():
        return None
    parents = _process_parents(root)  # one read of every process's stat
    me, launcher = os.getpid(), os.getppid()
    ranks = {me} | {pid for pid, ppid in parents.items() if ppid == launcher}
    skipped = ranks | _ancestors(me, parents)
    found = []
    for pid, ppid in sorted(parents.items()):
        # A DataLoader worker of a rank of this launch is no stale worker either.
        if pid in skipped or ppid in ranks:
            continue
        try:
            environ = (root / str(pid) / "environ").read_bytes().split(b"\0")
            if not any(v.startswith(WORKER_VARIABLES) for v in environ):
                continue
            cmdline = (root / str(pid) / "cmdline").read_bytes()
        except OSError:  # gone, or another user's
            continue
        local = next(
            (v[len(b"LOCAL_RANK=") :] for v in environ if v.startswith(b"LOCAL_RANK=")), b""
        )
        found.append(
            {
                "pid": pid,
                "ppid": ppid,
                "orphaned": ppid == 1,
                "local_rank": local.decode(errors="replace") or None,
                "cmdline": cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200],
            }
        )
        if len(found) >= MAX_STALE_SHOWN:
            break
    return found


def _process_parents(root: Path) -> dict[int, int]:
    """pid -> parent pid of every process /proc shows (the stat line's fourth field)."""
    parents = {}
    for entry in root.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # The command name may hold spaces and parentheses: split after the last ")".
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    """The launcher of `pid` and its callers (never init, which adopts orphans)."""
    found: set[int] = set()
    while (pid := parents.get(pid, 1)) > 1 and pid not in found:
        found.add(pid)
    return found


def shm_space(path: str = "/dev/shm") -> dict | None:
    """Size and free space of the shared-memory filesystem NCCL and DataLoader use."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return {
        "path": path,
        "total_mib": stats.f_blocks * stats.f_frsize // MIB,
        "free_mib": stats.f_bavail * stats.f_frsize // MIB,
    }


def _limit(name: str) -> dict:
    """A resource limit (None means unlimited, or unknown on this platform)."""
    if resource is None or not hasattr(resource, name):
        return {"soft": None, "hard": None}
    soft, hard = resource.getrlimit(getattr(resource, name))
    unlimited = resource.RLIM_INFINITY
    return {
        "soft": None if soft == unlimited else soft,
        "hard": None if hard == unlimited else hard,
    }


def _memory() -> dict:
    values = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "SwapTotal"):
                values[key] = int(rest.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        return {}
    return {
        "total_mib": values.get("MemTotal"),
        "available_mib": values.get("MemAvailable"),
        "swap_mib": values.get("SwapTotal"),
    }


def _oom_signs() -> dict:
    """OOM-killer counters: the kernel's since boot and this cgroup's."""
    signs: dict = {"vmstat_oom_kill": None, "cgroup_oom_kill": None, "cgroup_memory_max_mib": None}
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                signs["vmstat_oom_kill"] = int(line.split()[1])
    except (OSError, ValueError):
        pass
    folder = _cgroup_v2_folder()
    if folder is not None:
        signs["cgroup_oom_kill"] = _key_value(folder / "memory.events", "oom_kill")
        signs["cgroup_memory_max_mib"] = _mib_or_none(folder / "memory.max")
    else:  # cgroup v1
        v1 = Path("/sys/fs/cgroup/memory")
        signs["cgroup_oom_kill"] = _key_value(v1 / "memory.oom_control", "oom_kill")
        signs["cgroup_memory_max_mib"] = _mib_or_none(v1 / "memory.limit_in_bytes")
    return signs


def _cgroup_v2_folder() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                folder = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
                return folder if (folder / "memory.events").exists() else None
    except OSError:
        pass
    return None


def _key_value(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


def _mib_or_none(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= 1 << 60:  # "max" or v1's "unlimited" huge value
        return None
    return int(text) // MIB


def _in_container() -> bool:
    if Path("/.dockerenv").exists() or os.environ.get("container"):
        return True
    try:
        text = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return bool(re.search(r"docker|kubepods|containerd|lxc", text))


def nccl_interfaces(spec: str | None, nics: list[dict]) -> list[str]:
    """The interfaces NCCL's socket transport would use, following its rules.

    Unset: ib* first, else every interface but lo and docker*, else docker*,
    else lo. Set: a comma list of prefixes; '^' excludes them, '=' asks for
    exact names.
    """
    usable = [n["name"] for n in nics if n["up"] is not False and (n["ipv4"] or n["ipv6"])]
    if not spec:
        for rule in ("ib", "^docker,lo", "docker", "lo"):
            chosen = _match_nccl(rule, usable)
            if chosen:
                return chosen
        return []
    return _match_nccl(spec, usable)


def _match_nccl(spec: str, names: list[str]) -> list[str]:
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    prefixes = [p for p in spec.lstrip("=").split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in prefixes)

    return [name for name in names if hit(name) != exclude]


def gloo_interfaces(spec: str | None, nics: list[dict]) -> list[str] | None:
    """The interfaces GLOO_SOCKET_IFNAME names that exist here.

    None when unset: gloo then binds to the address the hostname resolves
    to, falling back to loopback.
    """
    if not spec:
        return None
    present = {n["name"] for n in nics}
    return [name for name in spec.split(",") if name in present]


def _peer_access() -> dict | None:
    """Which GPU pairs can access each other's memory directly (P2P)."""
    cuda = cuda_status()
    if not cuda["available"] or cuda["device_count"] < 2:
        return None
    import torch

    pairs = []
    for a in range(cuda["device_count"]):
        for b in range(cuda["device_count"]):
            if a != b:
                try:
                    pairs.append([a, b, bool(torch.cuda.can_device_access_peer(a, b))])
                except Exception as exc:  # noqa: BLE001 - report the error instead of losing the other facts
                    return {"error": one_line(exc)}
    return {"pairs": pairs, "all": all(p[2] for p in pairs)}


def _iommu() -> dict:
    """Whether an IOMMU translates device DMA ("DMA"/"DMA-FQ") or passes it through."""
    groups = Path("/sys/kernel/iommu_groups")
    types = set()
    count = 0
    if groups.is_dir():
        for group in groups.iterdir():
            count += 1
            try:
                types.add((group / "type").read_text().strip())
            except OSError:
                pass
    try:
        cmdline = Path("/proc/cmdline").read_text()
    except OSError:
        cmdline = ""
    flags = re.findall(r"\b(?:intel_iommu|amd_iommu|iommu)=\S+", cmdline)
    return {"groups": count, "types": sorted(types), "cmdline": flags}


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
