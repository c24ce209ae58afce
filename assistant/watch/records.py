"""What the job's processes wrote about themselves (see jobhook), read back as data.

Each Python process of the job left WATCH_DIR/procs/<pid>.json and, when it
raised, <pid>.error.json. From them: which processes are ranks (and which
rank), which are launchers (torchrun's agent, mp.spawn's parent), each
rank's exception and exit code, and the root error of the failure: the
earliest exception a rank raised, else the launcher's account of a rank
that died without one (SIGKILL), else the launcher's own error (a busy port
fails in torchrun's agent before any rank starts).
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from assistant.results import RootError
from assistant.watch.jobhook import procs_dir

# How a launcher process shows in its argv (it is one even before it starts a rank).
LAUNCHER_MARKERS = ("torch.distributed.run", "torch.distributed.launch", "torchrun")
# Helper processes of multiprocessing: they run the hook but are no rank.
HELPER_MARKERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# Errors a rank raises only because a peer went away: never the root when a
# rank died of a signal without an exception of its own (SIGKILL, SIGSEGV).
PEER_LOSS = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote process exited|"
    r"Socket Timeout|NCCL communicator was aborted",
    re.IGNORECASE,
)
# Signals a launcher sends the surviving ranks itself: not how a failure starts.
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Launcher exceptions that only say "a rank failed": the rank's own error is the root.
WRAPPER_ERRORS = ("ChildFailedError", "ProcessRaisedException", "ProcessExitedException")


@dataclass
class ProcessRecord:
    """One process of the job, as its hook recorded it."""

    pid: int
    ppid: int
    host: str
    argv: list[str]
    env: dict[str, str]
    main_thread: int | None
    started: float
    stack_signal: int | None
    dist_rank: int | None = None
    spawn_index: int | None = None
    error: dict | None = None
    exited_cleanly: bool = False
    children: list[int] = field(default_factory=list)

    @property
    def rank(self) -> int | None:
        """The global rank: torch.distributed's, else the launcher's variables, else mp.spawn's index."""
        if self.dist_rank is not None:
            return self.dist_rank
        for name in ("RANK", "SLURM_PROCID"):
            if self.env.get(name, "").isdigit():
                return int(self.env[name])
        return self.spawn_index

    @property
    def local_rank(self) -> int | None:
        for name in ("LOCAL_RANK", "SLURM_LOCALID"):
            if self.env.get(name, "").isdigit():
                return int(self.env[name])
        return self.spawn_index

    @property
    def launcher(self) -> bool:
        """torchrun's agent or mp.spawn's parent: it starts ranks, it is none."""
        if self.rank is not None:
            return False
        words = [os.path.basename(word) for word in self.argv[:4]] + self.argv[:4]
        return bool(self.children) or any(marker in words for marker in LAUNCHER_MARKERS)

    @property
    def helper(self) -> bool:
        return any(marker in " ".join(self.argv) for marker in HELPER_MARKERS)

    def file(self, watch_dir: Path, suffix: str) -> Path:
        return Path(procs_dir(str(watch_dir))) / f"{self.pid}{suffix}"


@dataclass
class JobRecords:
    """Every recorded process of one launch."""

    processes: dict[int, ProcessRecord]

    @property
    def ranks(self) -> list[ProcessRecord]:
        """Processes that are ranks, by rank (the first process per rank)."""
        chosen: dict[int, ProcessRecord] = {}
        for record in sorted(self.processes.values(), key=lambda r: r.started):
            if record.rank is not None and not record.helper:
                chosen.setdefault(record.rank, record)
        return [chosen[rank] for rank in sorted(chosen)]

    @property
    def launchers(self) -> list[ProcessRecord]:
        """Rank-less processes that started recorded processes (torchrun, mp.spawn's parent)."""
        return [r for r in self.processes.values() if r.launcher]

    @property
    def rankless_workers(self) -> list[ProcessRecord]:
        """Rank-less processes that raised and started nobody (a plain `python train.py`)."""
        return [
            r
            for r in self.processes.values()
            if r.rank is None and not r.launcher and not r.helper and r.error
        ]

    def root_error(self) -> tuple[RootError, str] | None:
        """The root error and the text to ask about it (its traceback), or None.

        The earliest exception a rank raised, unless it only reports a lost
        peer and a rank died of a signal without one: that death came first.
        Else the launcher's own error (a busy port fails in torchrun's agent).
        """
        raised = sorted(
            (r for r in self.ranks + self.rankless_workers if r.error),
            key=lambda r: r.error["time"],
        )
        own = [r for r in raised if not PEER_LOSS.search(r.error["message"])]
        if own:
            return _raised(own[0])
        killed = self.killed_without_exception()
        if killed:
            return died_without_exception(*killed[0])
        if raised:
            return _raised(raised[0])
        for launcher in sorted(self.launchers, key=lambda r: r.started):
            error = launcher.error
            if error is not None and not error["type"].endswith(WRAPPER_ERRORS):
                return RootError(error["type"], error["message"], None), error["traceback"]
        return None

    def killed_without_exception(self) -> list[tuple[dict, dict]]:
        """(launcher error, failure) for each rank a signal killed before it could raise."""
        with_error = {r.pid for r in self.processes.values() if r.error}
        killed = []
        for launcher in self.launchers:
            for failure in (launcher.error or {}).get("failures", []):
                code = failure.get("exit_code")
                if (
                    isinstance(code, int)
                    and code < 0
                    and -code not in LAUNCHER_SIGNALS
                    and failure.get("pid") not in with_error
                ):
                    killed.append((launcher.error, failure))
        return killed

    def exit_code(self, record: ProcessRecord) -> int | None:
        """A rank's exit code: the launcher's figure, else 1 after an exception, 0 after a clean exit."""
        for launcher in self.launchers:
            for failure in (launcher.error or {}).get("failures", []):
                if failure.get("pid") == record.pid or (
                    failure.get("pid") is None and failure.get("rank") == record.rank
                ):
                    return failure.get("exit_code")
        if record.error is not None:
            return 1
        return 0 if record.exited_cleanly else None


def _raised(record: ProcessRecord) -> tuple[RootError, str]:
    error = record.error
    return RootError(error["type"], error["message"], record.rank), error["traceback"]


def died_without_exception(launcher_error: dict, failure: dict) -> tuple[RootError, str]:
    """A rank that died without raising (killed by a signal): the launcher's account of it."""
    code = failure["exit_code"]
    rank = failure.get("rank")
    message = f"rank {rank} (local_rank: {failure.get('local_rank')}) exitcode: {code} (pid: {failure.get('pid')})"
    if isinstance(code, int) and code < 0:
        signame = signal_name(-code)
        message += f"\nSignal {-code} ({signame}) received by PID {failure.get('pid')}"
    root = RootError(launcher_error["type"], message, rank)
    return root, f"{launcher_error['type']}: {message}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def read_records(watch_dir: Path) -> JobRecords:
    """Every process record under a watch folder (records being written are skipped)."""
    folder = Path(procs_dir(str(watch_dir)))
    processes: dict[int, ProcessRecord] = {}
    for path in folder.glob("*.json"):
        if not path.stem.isdigit():
            continue  # <pid>.error.json has stem "<pid>.error"
        data = read_json(path)
        if data is None:
            continue
        record = ProcessRecord(
            pid=data["pid"],
            ppid=data["ppid"],
            host=data.get("host", ""),
            argv=list(data.get("argv", [])),
            env=dict(data.get("env", {})),
            main_thread=data.get("main_thread"),
            started=data.get("started", 0.0),
            stack_signal=data.get("stack_signal"),
            dist_rank=data.get("dist_rank"),
            spawn_index=data.get("spawn_index"),
            error=read_json(folder / f"{data['pid']}.error.json"),
            exited_cleanly=(folder / f"{data['pid']}.exit").exists(),
        )
        processes[record.pid] = record
    for record in processes.values():
        if record.ppid in processes:
            processes[record.ppid].children.append(record.pid)
    return JobRecords(processes)


def read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as source:
            return json.load(source)
    except (OSError, ValueError):
        return None


def progress_count(path: Path) -> int:
    """The collective-exit counter a rank's hook keeps (0 when absent)."""
    try:
        with open(path, "rb") as source:
            return int(source.read(20).strip() or 0)
    except (OSError, ValueError):
        return 0
