"""Running the probes through torchrun, safely.

One launch runs every requested probe (probes/run_probes.py imports them in
the same processes), so `assistant doctor` costs about one bare torchrun
start. Only set_device_order needs more: each of its variants gets a launch
of its own, and only when the first launch found CUDA and NCCL.

Every launch is `<python> -m torch.distributed.run` without a shell, on a
free port, in its own session, under a deadline. Each probe also has a
budget from the moment it starts; when a probe overruns it, or on cancel or
Ctrl-C, every process of the launch is killed (SIGTERM, then SIGKILL). The
processes are found by a marker in their environment, because torchrun puts
its workers in sessions of their own where a process-group kill misses them.
The facts a hung probe wrote before it hung are kept; probes that had not
started yet get a second launch.

Standard library only (plus assistant.results / config / probe_registry):
GPU machines that run this may lack the assistant's heavier dependencies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from assistant.config import probes_dir
from assistant.probing.registry import PROBES, ProbeSpec
from assistant.results import ProbeRun

BATCH_SCRIPT = "run_probes.py"
POLL_SECONDS = 0.05
KILL_GRACE_SECONDS = 2.0
FACTS_FORMAT = 1
# Variables torchrun owns. The user's values reach the probes as
# PROBE_USER_<NAME> (the rendezvous probe checks the user's endpoint, not
# the free port of this launch) and must not steer the launch itself.
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
USER_PREFIX = "PROBE_USER_"
LAUNCH_ID_VAR = "PROBE_LAUNCH_ID"


@dataclass
class ProgressEvent:
    """A probe started or finished; elapsed counts seconds since run() began."""

    probe: str
    state: str  # "started" | "finished"
    elapsed: float
    status: str | None = None


@dataclass
class _End:
    """Why a launch stopped."""

    reason: str  # "done" | "exit" | "timeout" | "probe_timeout" | "cancelled"
    code: int | None = None
    hung: str | None = None
    seconds: float = 0.0


@dataclass
class _Launch:
    """One torchrun start and what it left behind."""

    probes: list[str]
    nproc: int
    end: _End
    records: dict[tuple[str, int], dict]
    log_tail: list[str]
    budgets: dict[str, float]
    started_at: dict[str, float] = field(default_factory=dict)
    timeout: float = 0.0


class ProbeRunner:
    """Runs registered probes through torchrun in the user's environment.

    python: the interpreter of the training environment (default: this one).
    nproc_per_node: ranks per launch (default: the visible GPUs, or 2).
    timeout: seconds one torchrun launch may take.
    env: variables laid over os.environ for the launch (CUDA_VISIBLE_DEVICES,
    NCCL_*, MASTER_PORT, ...), as if the user had exported them.
    probe_timeout: caps every probe's own budget (tests use a short one).
    """

    def __init__(
        self,
        python: str | None = None,
        nproc_per_node: int | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        *,
        probe_timeout: float | None = None,
    ):
        self.python = _interpreter(python)
        if nproc_per_node is not None and nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, not {nproc_per_node}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        self.env = dict(env or {})
        self.nproc_source = "user" if nproc_per_node else "default"
        self.nproc_per_node = nproc_per_node or visible_gpu_count(self._user_env()) or 2
        self.timeout = float(timeout)
        self.probe_timeout = probe_timeout
        self.launches = 0  # torchrun starts so far (the benchmark and tests count them)

    def run(
        self,
        names: list[str],
        on_progress: Callable[[ProgressEvent], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> list[ProbeRun]:
        """Run the named probes; one ProbeRun per name, in the order given.

        Raises ValueError for an unknown name. On KeyboardInterrupt every
        process of the launch is killed before the interrupt propagates.
        """
        specs = _specs(names)
        held = {spec.name for spec in specs if spec.variants}  # finished only after the variants
        progress = _Progress(on_progress, held)
        runs: dict[str, ProbeRun] = {}
        pending = [spec.name for spec in specs]
        while pending:
            script = probes_dir() / BATCH_SCRIPT
            launch = self._launch(script, pending, list(pending), progress, cancel)
            batch, pending = _batch_runs(launch)
            runs.update(batch)
            for name, run in batch.items():  # those cut short finish here, not after a rerun
                progress.report(name, "finished", run.status)
            if launch.end.reason == "cancelled":
                break
        for spec in specs:
            if not spec.variants or runs[spec.name].status != "ok":
                continue  # no variants, or the preflight says they cannot run here
            if _cancelled(cancel):
                preflight = runs[spec.name]
                runs[spec.name] = ProbeRun(
                    spec.name,
                    "interrupted",
                    preflight.seconds,
                    preflight.ranks,
                    "stopped before its variants ran",
                )
            else:
                runs[spec.name] = self._run_variants(spec, runs[spec.name], progress, cancel)
        for name in dict.fromkeys(names):
            progress.finished(name, runs[name].status)
        return [runs[name] for name in names]

    def _run_variants(self, spec: ProbeSpec, preflight: ProbeRun, progress, cancel) -> ProbeRun:
        """One launch per variant, merged into one ProbeRun with the preflight."""
        launches: dict[str, _Launch] = {}
        for variant in spec.variants:
            if _cancelled(cancel):
                break
            launch = self._launch(
                spec.script, [spec.name], ["--variant", variant], progress, cancel, variant
            )
            launches[variant] = launch
            if launch.end.reason == "cancelled":
                break
        return _merge_variants(spec, preflight, launches, cancelled=_cancelled(cancel))

    def _launch(
        self,
        script: Path,
        probes: list[str],
        script_args: list[str],
        progress: _Progress,
        cancel: threading.Event | None,
        variant: str | None = None,
    ) -> _Launch:
        """Start torchrun once, watch it, and collect the records it wrote."""
        workdir = Path(tempfile.mkdtemp(prefix="ddp-probes-"))
        try:
            launch = self._start_and_watch(
                workdir / "1", script, probes, script_args, progress, cancel, variant
            )
            if _lost_port_race(launch):  # the free port was taken between pick and bind
                launch = self._start_and_watch(
                    workdir / "2", script, probes, script_args, progress, cancel, variant
                )
            return launch
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _start_and_watch(
        self, workdir, script, probes, script_args, progress, cancel, variant
    ) -> _Launch:
        facts_dir = workdir / "facts"
        facts_dir.mkdir(parents=True)
        launch_id = uuid.uuid4().hex
        budgets = {name: self._budget(PROBES[name]) for name in probes}
        command = [
            self.python,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc_per_node={self.nproc_per_node}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            "--max_restarts=0",
            str(script),
            *script_args,
        ]
        log_path = workdir / "launch.log"
        self.launches += 1
        started = time.monotonic()
        watch = _Watch(facts_dir, probes, self.nproc_per_node)
        with open(log_path, "wb") as log:
            try:
                process = subprocess.Popen(
                    command,
                    env=self._launch_env(facts_dir, launch_id, variant),
                    cwd=workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                end = _End("exit", code=-1)
                return _Launch(
                    probes,
                    self.nproc_per_node,
                    end,
                    {},
                    [f"cannot start {self.python}: {exc}"],
                    budgets,
                )
            try:
                end = self._watch(process, launch_id, watch, budgets, progress, cancel, started)
            except BaseException:  # KeyboardInterrupt above all: leave nothing running
                _kill_launch(process, launch_id)
                raise
        end.seconds = time.monotonic() - started
        return _Launch(
            probes,
            self.nproc_per_node,
            end,
            watch.records,
            _log_tail(log_path),
            budgets,
            dict(watch.first_seen),
            self.timeout,
        )

    def _watch(self, process, launch_id, watch, budgets, progress, cancel, started) -> _End:
        """Poll until the launch exits, overruns, hangs in a probe, or is cancelled."""
        deadline = started + self.timeout
        while True:
            code = process.poll()
            now = time.monotonic()
            for event in watch.update(now):
                progress.report(*event)
            if code is not None:
                return _End("exit", code=code)
            if watch.all_done():
                # Every record is final: the interpreters' teardown (seconds)
                # is of no use to us, so end the launch now.
                _kill_launch(process, launch_id)
                return _End("done", code=0)
            if _cancelled(cancel):
                _kill_launch(process, launch_id)
                return _End("cancelled")
            hung = watch.overdue(budgets, now)
            if hung:
                _kill_launch(process, launch_id)
                return _End("probe_timeout", hung=hung)
            if now > deadline:
                _kill_launch(process, launch_id)
                return _End("timeout")
            time.sleep(POLL_SECONDS)

    def _budget(self, spec: ProbeSpec) -> float:
        budget = min(spec.timeout, self.timeout)
        return min(budget, self.probe_timeout) if self.probe_timeout else budget

    def _user_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        return env

    def _launch_env(self, facts_dir: Path, launch_id: str, variant: str | None) -> dict[str, str]:
        env = self._user_env()
        for key in list(env):
            if key in LAUNCHER_VARS or key.startswith(LAUNCHER_PREFIXES):
                env[USER_PREFIX + key] = env.pop(key)
        env.pop("PYTHONSAFEPATH", None)  # the probes import their helper from their own folder
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it, with a banner
        env.update(
            PROBE_RUNNER="1",
            PROBE_FACTS_DIR=str(facts_dir),
            PROBE_NPROC_SOURCE=self.nproc_source,
            PYTHONUNBUFFERED="1",
        )
        env[LAUNCH_ID_VAR] = launch_id
        if variant:
            env["PROBE_VARIANT"] = variant
        return env


# --- watching a launch --------------------------------------------------------


class _Watch:
    """The records of one launch as they appear, and which probes are done."""

    def __init__(self, facts_dir: Path, probes: list[str], nproc: int):
        self.facts_dir = facts_dir
        self.probes = probes
        self.nproc = nproc
        self.records: dict[tuple[str, int], dict] = {}
        self.first_seen: dict[str, float] = {}
        self.done: set[str] = set()
        self._stamps: dict[str, tuple[int, int]] = {}

    def update(self, now: float) -> list[tuple[str, str, str | None]]:
        """Reread changed records; return (probe, "started"|"finished", status) events."""
        self._read()
        events = []
        for name in self.probes:
            mine = [self.records.get((name, rank)) for rank in range(self.nproc)]
            if name not in self.first_seen and any(mine):
                self.first_seen[name] = now
                events.append((name, "started", None))
            if name not in self.done and all(r and r["status"] != "running" for r in mine):
                self.done.add(name)
                events.append((name, "finished", _status_of(mine)[0]))
        return events

    def all_done(self) -> bool:
        return len(self.done) == len(self.probes)

    def overdue(self, budgets: dict[str, float], now: float) -> str | None:
        """The first started, unfinished probe past its budget."""
        for name in self.probes:
            since = self.first_seen.get(name)
            if since is not None and name not in self.done and now - since > budgets[name]:
                return name
        return None

    def _read(self) -> None:
        try:
            entries = list(os.scandir(self.facts_dir))
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue  # a record being written (write-then-rename)
            stat = entry.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if self._stamps.get(entry.name) == stamp:
                continue
            try:
                record = json.loads(Path(entry.path).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            self._stamps[entry.name] = stamp
            self.records[(record.get("probe"), record.get("rank"))] = record


class _Progress:
    """Reports each probe's start and finish once to the caller's callback."""

    def __init__(self, callback: Callable[[ProgressEvent], None] | None, held: set[str]):
        self.callback = callback
        self.held = held
        self.began = time.monotonic()
        self.started: set[str] = set()
        self.ended: set[str] = set()

    def report(self, probe: str, state: str, status: str | None) -> None:
        if state == "started" and probe not in self.started:
            self.started.add(probe)
            self._emit(ProgressEvent(probe, "started", time.monotonic() - self.began))
        elif state == "finished" and probe not in self.held:
            self.finished(probe, status)

    def finished(self, probe: str, status: str | None) -> None:
        if probe in self.ended:
            return
        self.ended.add(probe)
        self._emit(ProgressEvent(probe, "finished", time.monotonic() - self.began, status))

    def _emit(self, event: ProgressEvent) -> None:
        if self.callback is not None:
            self.callback(event)


# --- turning records into ProbeRuns -------------------------------------------


def _status_of(records: list[dict]) -> tuple[str, str]:
    """A probe's status and one-line detail from its final per-rank records."""
    statuses = [r["status"] for r in records]
    for status in ("error", "timeout", "interrupted", "failed"):
        if status in statuses:
            culprit = next(r for r in records if r["status"] == status)
            return status, _detail(culprit)
    if all(s == "not_applicable" for s in statuses):
        return "not_applicable", records[0].get("reason") or ""
    return "ok", _detail(records[0])


def _detail(record: dict) -> str:
    text = (
        "; ".join(record.get("problems") or [])
        or record.get("reason")
        or record.get("summary")
        or ""
    )
    rank = record.get("rank")
    if record.get("status") in ("failed", "error", "timeout") and rank is not None:
        text = f"rank {rank}: {text}"
    return " ".join(text.split())


def _batch_runs(launch: _Launch) -> tuple[dict[str, ProbeRun], list[str]]:
    """ProbeRuns of a batch launch, and the probes to run again.

    After a probe hung, the probes that never started get another launch.
    """
    runs: dict[str, ProbeRun] = {}
    rerun: list[str] = []
    end = launch.end
    for name in launch.probes:
        seen = name in launch.started_at
        if end.reason == "probe_timeout" and not seen:
            rerun.append(name)
            continue
        ranks, status, detail = _finish_records(launch, name)
        runs[name] = ProbeRun(name, status, _seconds(launch, name, ranks), ranks, detail)
    return runs, rerun


def _finish_records(launch: _Launch, name: str) -> tuple[list[dict], str, str]:
    """Every rank's record of a probe, completing those the launch cut short."""
    records = [launch.records.get((name, rank)) for rank in range(launch.nproc)]
    if all(r and r["status"] != "running" for r in records):
        status, detail = _status_of(records)
        return records, status, detail
    status, detail = _cut_short(launch, name, records)
    completed = []
    for rank, record in enumerate(records):
        if record is None:
            record = _placeholder(name, rank, status, detail)
        elif record["status"] == "running":
            record = {**record, "status": status, "reason": detail}
        completed.append(record)
    return completed, status, detail


def _cut_short(launch: _Launch, name: str, records: list[dict | None]) -> tuple[str, str]:
    """Status and detail of a probe whose launch ended before all ranks finished."""
    end = launch.end
    if end.reason == "cancelled":
        return "interrupted", "stopped before it finished"
    if end.reason == "probe_timeout":
        if name == end.hung:
            step = next(
                (r["facts"].get("step") for r in records if r and r["facts"].get("step")), None
            )
            where = f" (stuck in {step})" if step else ""
            return "timeout", f"no answer within {launch.budgets[name]:g} s{where}"
        return "timeout", f"stopped: other ranks were stuck in {end.hung}"
    if end.reason == "timeout":
        if name in launch.started_at:
            return "timeout", f"no answer before the launch deadline ({launch.timeout:g} s)"
        return "timeout", f"not reached before the launch deadline ({launch.timeout:g} s)"
    return "error", _exit_detail(end.code, launch.log_tail)


def _placeholder(name: str, rank: int, status: str, reason: str) -> dict:
    """The record of a rank that never wrote one."""
    return {
        "probe": name,
        "format": FACTS_FORMAT,
        "status": status,
        "reason": reason,
        "summary": "",
        "problems": [],
        "seconds": 0.0,
        "rank": rank,
        "variant": None,
        "facts": {},
    }


def _seconds(launch: _Launch, name: str, ranks: list[dict]) -> float:
    """A probe's own time: its slowest rank, or its whole budget if it hung."""
    hung = any(r["status"] == "timeout" for r in ranks)
    if hung and launch.end.reason in ("probe_timeout", "timeout") and name in launch.started_at:
        return launch.budgets[name]
    return max((r.get("seconds") or 0.0) for r in ranks) if ranks else 0.0


def _exit_detail(code: int | None, log_tail: list[str]) -> str:
    """The error a crashed launch printed, e.g. "No module named 'torch'"."""
    for line in reversed(log_tail):
        if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", line):
            return line
    if log_tail:
        return log_tail[-1]
    return f"torchrun exited with code {code}"


def _merge_variants(
    spec: ProbeSpec, preflight: ProbeRun, launches: dict[str, _Launch], cancelled: bool
) -> ProbeRun:
    """Put each variant's per-rank record under facts["variants"] of the preflight records."""
    ranks = [dict(record, facts=dict(record["facts"], variants={})) for record in preflight.ranks]
    outcomes: dict[str, str] = {}
    seconds = preflight.seconds
    for variant, launch in launches.items():
        records, status, _ = _finish_records(launch, spec.name)
        outcomes[variant] = _variant_outcome(status, records)
        seconds += launch.end.seconds
        for rank, record in zip(ranks, records):
            rank["facts"]["variants"][variant] = {
                key: record.get(key)
                for key in ("status", "reason", "problems", "seconds", "pid", "facts")
            }
    kinds = {outcome.split()[0] for outcome in outcomes.values()}
    if (cancelled and len(outcomes) < len(spec.variants)) or "interrupted" in kinds:
        status = "interrupted"
    elif kinds == {"ok"}:
        status = "ok"
    elif kinds == {"hang"}:
        status = "timeout"
    elif kinds == {"error"}:
        status = "error"
    else:
        status = "failed"
    detail = "; ".join(f"{variant} {outcome}" for variant, outcome in outcomes.items())
    return ProbeRun(spec.name, status, seconds, ranks, detail)


def _variant_outcome(status: str, records: list[dict]) -> str:
    """ok, failed at <step>, hang at <step>, error, or interrupted.

    A rank that failed outranks one that hung: the others usually hang
    waiting for the rank whose error is the reason.
    """
    failed = [r for r in records if r["status"] == "failed"]
    if failed:
        step = failed[0]["facts"].get("failed_step")
        return f"failed at {step}" if step else "failed"
    if status == "timeout":
        step = next((r["facts"].get("step") for r in records if r["facts"].get("step")), None)
        return f"hang at {step}" if step else "hang"
    return status


# --- processes ----------------------------------------------------------------


def _kill_launch(process: subprocess.Popen, launch_id: str) -> None:
    """Kill torchrun and every process carrying this launch's marker.

    SIGTERM first so the workers can exit cleanly, SIGKILL for whatever is
    still alive after a grace period. Once its workers are gone torchrun
    has nothing left to clean up, so it is not given the second or two its
    own shutdown takes. Without /proc (macOS) the workers cannot be seen:
    torchrun then gets a longer grace to stop them itself.
    """
    visible = Path("/proc/self").is_dir()
    first_grace = KILL_GRACE_SECONDS if visible else 10.0
    for sig, grace in ((signal.SIGTERM, first_grace), (signal.SIGKILL, 5.0)):
        targets = set(launch_processes(launch_id))
        if process.poll() is None:
            targets.add(process.pid)
            _signal_group(process.pid, sig)
        for pid in targets:
            _signal(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            # Check torchrun first: once it is dead it cannot start another
            # worker, so an empty scan after that is final.
            dead = process.poll() is not None
            left = set(launch_processes(launch_id)) - {process.pid}
            if not left:
                if dead:
                    return
                if visible:
                    _signal(process.pid, signal.SIGKILL)
            time.sleep(POLL_SECONDS)
    process.wait(timeout=5)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch_processes(launch_id: str) -> list[int]:
    """Live processes whose environment carries PROBE_LAUNCH_ID=launch_id.

    Zombies have an empty environment in /proc, so they are not listed.
    """
    marker = f"{LAUNCH_ID_VAR}={launch_id}".encode()
    found = []
    if not Path("/proc/self").is_dir():
        return found  # no /proc (macOS): only torchrun itself can be signalled
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or another user's process
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _log_tail(path: Path, lines: int = 40) -> list[str]:
    """The last lines of the launch log, without torch's [rankN]: prefixes."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    cleaned = [re.sub(r"^\[(?:rank)?\d+\]:\s*", "", line).strip() for line in text.splitlines()]
    return [line for line in cleaned if line][-lines:]


def _lost_port_race(launch: _Launch) -> bool:
    return (
        launch.end.reason == "exit"
        and not launch.records
        and any(
            "EADDRINUSE" in line or "address already in use" in line.lower()
            for line in launch.log_tail
        )
    )


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


# --- settings -----------------------------------------------------------------


def _specs(names: list[str]) -> list[ProbeSpec]:
    unknown = [name for name in names if name not in PROBES]
    if unknown:
        raise ValueError(f"unknown probe {', '.join(unknown)} (known: {', '.join(PROBES)})")
    return [PROBES[name] for name in dict.fromkeys(names)]


def _interpreter(python: str | None) -> str:
    """The training environment's python, checked to exist and be executable."""
    if python is None:
        return sys.executable
    found = shutil.which(python)
    if found is None:
        raise ValueError(f"no python interpreter at {python}")
    return found


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def visible_gpu_count(env: dict[str, str] | None = None) -> int:
    """GPUs a process would see, without importing torch.

    The driver's GPUs (nvidia-smi -L, else /proc/driver/nvidia/gpus),
    narrowed by CUDA_VISIBLE_DEVICES the way CUDA reads it: entries up to
    the first invalid one.
    """
    env = os.environ if env is None else env
    physical = physical_gpu_count()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < physical):
            count += 1
        else:
            break
    return min(count, physical)


def physical_gpu_count() -> int:
    """NVIDIA GPUs the driver reports (0 without a driver)."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15, check=False
            ).stdout
            return sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            pass
    folder = Path("/proc/driver/nvidia/gpus")
    return len(list(folder.iterdir())) if folder.is_dir() else 0


# --- recorded facts -------------------------------------------------------------


def save_runs(path: Path, runs: list[ProbeRun], scenario: str = "", description: str = "") -> None:
    """Write probe runs as a facts file (the format of tests/fixtures/facts/)."""
    data = {
        "format": FACTS_FORMAT,
        "scenario": scenario,
        "description": description,
        "runs": [
            {
                "name": r.name,
                "status": r.status,
                "seconds": round(r.seconds, 3),
                "detail": r.detail,
                "ranks": r.ranks,
            }
            for r in runs
        ],
    }
    Path(path).write_text(
        json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8"
    )


def load_runs(path: Path) -> list[ProbeRun]:
    """Read a facts file written by save_runs."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return [
        ProbeRun(r["name"], r["status"], float(r["seconds"]), list(r["ranks"]), r.get("detail", ""))
        for r in data["runs"]
    ]
