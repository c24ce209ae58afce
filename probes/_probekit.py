"""Plumbing shared by the probe scripts: who this rank is, fact files, output.

Standard library and torch only (torch imported lazily): the probes run in
the user's training environment, which need not have the assistant
installed. Copy the whole probes/ folder to another node to run a probe
there.

A probe module defines NAME, a docstring with its torchrun command, and
`collect(ctx) -> dict`. The dict holds the probe's facts; an optional
"problems" list (one line each) marks the rank "failed" and an optional
"summary" string is the one-line answer shown to people. `collect` raises
NotApplicable(reason, facts) when the probe does not apply on this machine.

Each rank writes one JSON record per probe, `<probe>.rank<R>.json`, into the
folder named by PROBE_FACTS_DIR (or --out). The record is first written with
status "running" and rewritten at every checkpoint, so the facts a hung probe
gathered before it hung survive. The variable names, the record format and
its version are in probe_protocol.py, which the assistant's runner reads too.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import os
import socket
import struct
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

try:
    import fcntl  # POSIX: output locking and network interface flags
except ImportError:  # Windows: probes still run, with less detail
    fcntl = None

from probe_protocol import (  # noqa: F401  (FORMAT and the names are re-exported for probes)
    DEFAULT_PG_TIMEOUT,
    FACTS_DIR_ENV,
    FORMAT,
    PG_TIMEOUT_ENV,
    RUNNER_ENV,
    USER_PREFIX,
    VARIANT_ENV,
    new_record,
    record_filename,
    temp_record_filename,
)


class NotApplicable(Exception):
    """The probe does not apply on this machine; the message says why."""

    def __init__(self, reason: str, facts: dict | None = None):
        super().__init__(reason)
        self.facts = facts or {}


@dataclass(frozen=True)
class Rank:
    """This process's place in the launch, as the launcher told it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    host: str
    pid: int

    @classmethod
    def from_env(cls) -> Rank:
        """Read RANK and friends; a plain `python` start counts as rank 0 of 1."""
        return cls(
            rank=env_int("RANK", 0),
            local_rank=env_int("LOCAL_RANK", 0),
            world_size=env_int("WORLD_SIZE", 1),
            local_world_size=env_int("LOCAL_WORLD_SIZE", 1),
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    @property
    def launched(self) -> bool:
        """Whether a launcher set the env:// variables init_process_group needs."""
        return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_int(name: str, default: int | None = None) -> int | None:
    """The variable as an integer; default when it is unset, empty or not a number."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def under_runner() -> bool:
    """True when the assistant's runner started this launch."""
    return os.environ.get(RUNNER_ENV) == "1"


def user_env(name: str) -> str | None:
    """The user's own value of a launcher variable such as MASTER_PORT.

    The runner launches on a free port of its own and hands the user's
    values over as PROBE_USER_<NAME>; by hand the launch is the user's, so the
    environment itself holds them.
    """
    if under_runner():
        return os.environ.get(USER_PREFIX + name)
    return os.environ.get(name)


def one_line(exc: BaseException | str, limit: int = 400) -> str:
    """An exception as one line: 'Type: message', whitespace folded, cut at limit."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- fact records -----------------------------------------------------------


class ProbeContext:
    """What a probe's collect() gets: the rank, options, and a checkpoint."""

    def __init__(self, probe: str, rank: Rank, out_dir: Path | None, variant: str | None = None):
        self.probe = probe
        self.rank = rank
        self.out_dir = out_dir
        self.variant = variant
        self.started = time.monotonic()
        self.partial: dict = {}
        # A probe that leaves NCCL in a broken state asks for os._exit, since
        # a normal interpreter exit can wait forever on the NCCL watchdog.
        self.hard_exit = False

    def record(self, status: str, facts: dict, reason: str = "") -> dict:
        facts = dict(facts)
        problems = list(facts.pop("problems", []) or [])
        summary = str(facts.pop("summary", "") or "")
        return new_record(
            self.probe,
            status,
            reason=reason,
            summary=summary,
            problems=problems,
            seconds=round(time.monotonic() - self.started, 3),
            rank=self.rank.rank,
            local_rank=self.rank.local_rank,
            world_size=self.rank.world_size,
            local_world_size=self.rank.local_world_size,
            host=self.rank.host,
            pid=self.rank.pid,
            variant=self.variant,
            facts=facts,
        )

    def checkpoint(self, facts: dict) -> None:
        """Save the facts gathered so far; they survive if the probe then hangs."""
        self.partial = dict(facts)
        if self.out_dir is not None:
            write_record(self.out_dir, self.record("running", facts))


def record_path(out_dir: Path, probe: str, rank: int) -> Path:
    return out_dir / record_filename(probe, rank)


def write_record(out_dir: Path, record: dict) -> None:
    """Write a record atomically, so a reader never sees half a file."""
    path = record_path(out_dir, record["probe"], record["rank"])
    tmp = path.with_name(temp_record_filename(record["probe"], record["rank"], os.getpid()))
    tmp.write_text(json.dumps(record, default=str), encoding="utf-8")
    os.replace(tmp, path)


def run_probe(module, rank: Rank, out_dir: Path | None, variant: str | None = None) -> tuple:
    """Run one probe's collect() on this rank and write its record.

    Returns (record, context). Errors inside a probe become an "error"
    record that keeps the facts checkpointed before the error.
    """
    ctx = ProbeContext(module.NAME, rank, out_dir, variant)
    ctx.checkpoint({})  # the "running" record is the runner's start signal
    try:
        facts = module.collect(ctx)
        status = "failed" if facts.get("problems") else "ok"
        record = ctx.record(status, facts)
    except NotApplicable as exc:
        record = ctx.record("not_applicable", exc.facts, str(exc))
    except Exception as exc:  # noqa: BLE001 - a probe bug or a broken environment: report, go on
        record = ctx.record("error", ctx.partial, one_line(exc))
    if out_dir is not None:
        write_record(out_dir, record)
    return record, ctx


# --- output -----------------------------------------------------------------

_PRINT_LOCK = threading.Lock()


def say(rank: Rank, text: str) -> None:
    """Print one line prefixed with [host:rank], without interleaving ranks.

    The ranks of a launch share this file, so an flock on it serialises
    their output (the trick of stas00's torch-distributed-gpu-test.py).
    """
    line = f"[{rank.host}:{rank.rank}] {text}\n"
    with _PRINT_LOCK, open(__file__, "rb") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            sys.stdout.write(line)
            sys.stdout.flush()
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


def describe(record: dict) -> str:
    """The one-line answer of a record, for people."""
    text = record["summary"] or record["reason"]
    if record["problems"]:
        text = "; ".join(record["problems"])
    return f"{record['probe']}: {record['status']}" + (f": {text}" if text else "")


# --- torch helpers (imported lazily, cached for the whole launch) ----------

_cuda_cache: dict | None = None
_own_process_group = False


def cuda_status() -> dict:
    """torch's view of CUDA in this process, asked once per process.

    Warnings from the first CUDA call (e.g. "The NVIDIA driver on your system
    is too old") are kept, since torch prints them only once.
    """
    global _cuda_cache
    if _cuda_cache is None:
        import torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                available = torch.cuda.is_available()
                count = torch.cuda.device_count() if available else 0
                error = None
            except Exception as exc:  # noqa: BLE001 - a broken driver can raise here
                available, count, error = False, 0, one_line(exc)
        messages = [one_line(str(w.message)) for w in caught if "CUDA" in str(w.message)]
        _cuda_cache = {
            "built": torch.version.cuda is not None,
            "torch_cuda": torch.version.cuda,
            "available": available,
            "device_count": count,
            "error": error,
            "warning": messages[0] if messages else None,
        }
    return _cuda_cache


def pg_timeout() -> timedelta:
    try:
        seconds = float(os.environ.get(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT))
    except ValueError:
        seconds = DEFAULT_PG_TIMEOUT
    return timedelta(seconds=seconds)


def process_group(rank: Rank) -> None:
    """Make sure the default (gloo) process group exists, via env://."""
    global _own_process_group
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not rank.launched:
        raise NotApplicable(
            "not started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT missing"
        )
    dist.init_process_group("gloo", timeout=pg_timeout())
    _own_process_group = True


def close_process_group() -> None:
    """Destroy the default process group if a probe created it."""
    global _own_process_group
    if _own_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _own_process_group = False


def gpu_uuid(index: int) -> str | None:
    """The UUID of a visible device, "GPU-..." as nvidia-smi prints it."""
    import torch

    try:
        raw = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - old torch builds lack some device properties
        return None
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


# --- network helpers ---------------------------------------------------------

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


def interfaces() -> list[dict]:
    """This host's network interfaces: name, up, loopback, IPv4 and IPv6 addresses."""
    if fcntl is None or not hasattr(socket, "if_nameindex"):
        return []  # no ioctl here (Windows): the interface facts stay empty
    ipv6 = _ipv6_addresses()
    result = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            flags = _ioctl_int(sock, _SIOCGIFFLAGS, packed)
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)[20:24])
            except OSError:
                addr = None
            result.append(
                {
                    "name": name,
                    "up": bool(flags & _IFF_UP) if flags is not None else None,
                    "loopback": bool(flags & _IFF_LOOPBACK) if flags is not None else name == "lo",
                    "ipv4": addr,
                    "ipv6": ipv6.get(name, []),
                }
            )
    return result


def _ioctl_int(sock: socket.socket, request: int, packed: bytes) -> int | None:
    try:
        return struct.unpack("H", fcntl.ioctl(sock.fileno(), request, packed)[16:18])[0]
    except OSError:
        return None


def _ipv6_addresses() -> dict[str, list[str]]:
    addresses: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return addresses
    for line in lines:
        parts = line.split()
        if len(parts) == 6:
            hexaddr, name = parts[0], parts[5]
            text = ":".join(hexaddr[i : i + 4] for i in range(0, 32, 4))
            addresses.setdefault(name, []).append(str(ipaddress.ip_address(text)))
    return addresses


def resolve(host: str, limit: float = 3.0) -> dict:
    """Resolve a host name within a time limit (a dead DNS must not stall a probe)."""
    outcome: dict = {"host": host, "addresses": [], "error": None, "seconds": None}

    def lookup() -> None:
        started = time.monotonic()
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            outcome["addresses"] = sorted({info[4][0] for info in infos})
        except OSError as exc:
            outcome["error"] = one_line(exc)
        outcome["seconds"] = round(time.monotonic() - started, 3)

    worker = threading.Thread(target=lookup, daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        outcome["error"] = f"no answer within {limit:g} s"
    return outcome


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def connect(host: str, port: int, limit: float = 3.0) -> str:
    """Try a TCP connection: "ok", "refused", "timeout" or the error text."""
    try:
        with socket.create_connection((host, port), timeout=limit):
            return "ok"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
        return "timeout"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return "refused"
        return one_line(exc)


# --- entry point for running a probe by hand ---------------------------------


def main(module, argv: list[str] | None = None) -> int:
    """Run one probe on this rank: `torchrun --nproc_per_node=N probes/<name>.py`."""
    parser = argparse.ArgumentParser(
        description=(module.__doc__ or module.NAME).strip().splitlines()[0]
    )
    parser.add_argument("--out", help="folder for the JSON facts (default: print them)")
    variants = getattr(module, "VARIANTS", ())
    if variants:
        parser.add_argument("--variant", choices=variants, help="which variant to run")
    options = parser.parse_args(argv)
    out = options.out or os.environ.get(FACTS_DIR_ENV)
    out_dir = Path(out) if out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    variant = getattr(options, "variant", None) or os.environ.get(VARIANT_ENV) or None
    rank = Rank.from_env()
    record, ctx = run_probe(module, rank, out_dir, variant)
    say(rank, describe(record))
    if out_dir is None:
        say(rank, json.dumps(record["facts"], default=str))
    return finish(record["status"] in ("ok", "not_applicable"), ctx.hard_exit)


def finish(success: bool, hard_exit: bool = False) -> int:
    """Exit code of a probe process; under the runner always 0 (the records tell)."""
    code = 0 if success or under_runner() else 1
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    close_process_group()
    return code
