"""Running the user's launch under watch: output, records, hang detection, clean end.

    report = watch(["torchrun", "--nproc_per_node=2", "train.py"],
                   WatchOptions(hang_after=600), on_output=print_bytes)

The command runs without a shell, marked and in its own session
(assistant.probing.processes), with jobhook first on PYTHONPATH. The watch
loop streams output, and counts progress: new output, or a rank's main
thread leaving a collective. When nothing progresses for hang_after
seconds, every rank's stack is taken (faulthandler, nothing is killed),
then the job is ended (SIGTERM, grace, SIGKILL). Ctrl-C or SIGTERM to this
process is forwarded to every process of the job, which then gets a grace
period before the same kill; the interrupt goes on to the caller.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from assistant.errors import UserError
from assistant.probing.processes import (
    MarkedProcess,
    Terminated,
    send,
    start_marked,
    stop_requested,
)
from assistant.results import RootError
from assistant.watch import jobhook
from assistant.watch.flight import LastCollective, compare, last_collective, with_buffer
from assistant.watch.hang import HangAnalysis, RankPosition, analyse
from assistant.watch.output import OnOutput, OutputTail
from assistant.watch.records import (
    JobRecords,
    ProcessRecord,
    progress_count,
    read_json,
    read_records,
)
from assistant.watch.retention import Pruned, lock_run_folder, prune_old_runs, runs_dir
from assistant.watch.stacks import Frame, innermost_user_frame, main_thread, parse_dump, waiting_in

POLL_SECONDS = 0.1
STACK_WAIT_SECONDS = 3.0  # how long a rank gets to write its stacks after the signal
FLIGHT_WAIT_SECONDS = 2.0  # how long the ranks' sampling threads get to dump the flight recorder
FORWARD_GRACE_SECONDS = 5.0  # a forwarded Ctrl-C/SIGTERM before TERM->KILL
DEFAULT_HANG_AFTER = 600.0


@dataclass
class RunStart:
    """A launch about to start: where its logs go, and what pruning old logs did."""

    log_dir: Path
    pruned: Pruned


@dataclass
class WatchOptions:
    """How to watch a launch."""

    hang_after: float = DEFAULT_HANG_AFTER
    log_dir: Path | None = None
    cwd: Path | None = None
    env: dict[str, str] | None = None  # None: this process's environment
    # Set from another thread (the chat's stop key): the job is ended like a Ctrl-C.
    cancel: threading.Event | None = None
    # Called once the log folder is ready, before the job starts (to say where its logs go).
    on_start: Callable[[RunStart], None] | None = None


@dataclass
class RankReport:
    """One rank of the job at its end: the contract's `ranks[*]`."""

    rank: int | None
    host: str
    pid: int
    exit_code: int | None
    error: dict | None
    where: Frame | None = None
    waiting_in: str | None = None
    stack: list[Frame] = field(default_factory=list)
    last_collective: LastCollective | None = None  # from the flight recorder, at a hang
    local_rank: int | None = None

    def summary(self, message_chars: int = 120) -> str:
        """One line for people: `rank 1 (host, exit 1): ValueError: boom at train.py:12 in main`."""
        who = "process" if self.rank is None else f"rank {self.rank}"
        code = "exit code unknown" if self.exit_code is None else f"exit {self.exit_code}"
        if self.stack:
            code = "stack taken, then ended"
        parts = []
        if self.error:
            message = (self.error["message"].strip().splitlines() or [""])[0]
            if len(message) > message_chars:
                message = message[: message_chars - 1] + "…"
            parts.append(f"{self.error['type']}: {message}")
        if self.waiting_in:
            parts.append(f"waits in {self.waiting_in}")
        if self.where:
            parts.append(f"at {self.where.file}:{self.where.line} in {self.where.function}")
        head = f"{who} ({self.host}, {code})"
        return f"{head}: {' '.join(parts)}" if parts else head

    def to_json(self) -> dict:
        error = (
            {"type": self.error["type"], "message": self.error["message"]} if self.error else None
        )
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "host": self.host,
            "exit_code": self.exit_code,
            "error": error,
            "where": self.where.to_json() if self.where else None,
            "waiting_in": self.waiting_in,
            "last_collective": self.last_collective.to_json() if self.last_collective else None,
        }


@dataclass
class LaunchReport:
    """What happened to one watched launch."""

    command: list[str]
    exit_code: int | None  # None when the job was ended by us (a hang) or by a signal to us
    hung: bool
    log_dir: Path
    ranks: list[RankReport]
    root_error: RootError | None = None
    root_text: str = ""  # the text to ask about: the root traceback, else the output's end
    hang: HangAnalysis | None = None
    seconds: float = 0.0
    quiet_seconds: float | None = None  # how long nothing progressed before a hang was declared
    cancelled: bool = False  # ended on request (cancel, or a signal seen from a worker thread)
    gpu: list[str] = field(default_factory=list)  # nvidia-smi lines taken at a hang
    flight: list[str] = field(default_factory=list)  # the flight recorders compared, at a hang

    @property
    def failed(self) -> bool:
        """Worth an answer: it hung, or exited non-zero on its own."""
        return not self.cancelled and (self.hung or self.exit_code not in (0, None))

    def launch_json(self) -> dict:
        """The contract's `launch` object."""
        return {
            "command": list(self.command),
            "exit_code": self.exit_code,
            "hung": self.hung,
            "log_dir": str(self.log_dir),
        }

    def ranks_json(self) -> list[dict]:
        return [rank.to_json() for rank in self.ranks]


# --- setting up --------------------------------------------------------------------


def default_log_dir() -> Path:
    """A fresh folder under the user's cache for one run's logs (retention prunes old ones)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return runs_dir() / f"{stamp}-{uuid.uuid4().hex[:6]}"


def prepare_log_dir(log_dir: Path) -> Path:
    """Create the log folder, its procs/ and the hook folder; UserError if it cannot."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if any(log_dir.iterdir()):
            raise UserError(f"--log-dir {log_dir} is not empty: give a new or empty folder")
        Path(jobhook.procs_dir(str(log_dir))).mkdir()
        hook_dir = log_dir / "hook"
        hook_dir.mkdir()
        shutil.copyfile(jobhook.__file__, hook_dir / "sitecustomize.py")
    except OSError as exc:
        raise UserError(f"cannot use {log_dir} for logs: {exc.strerror or exc}") from None
    return hook_dir


def job_environment(base: dict[str, str], log_dir: Path, hook_dir: Path) -> dict[str, str]:
    """The user's environment plus the hook: first on PYTHONPATH, pointed at the log folder."""
    env = with_buffer(dict(base))
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(hook_dir) + (os.pathsep + existing if existing else "")
    env[jobhook.WATCH_DIR_VAR] = str(log_dir)
    env[jobhook.HOOK_DIR_VAR] = str(hook_dir)
    return env


def resolve_command(command: list[str], cwd: Path | None) -> list[str]:
    """The command with its program found on PATH; UserError when it cannot run."""
    if not command:
        raise UserError(
            "no command to run: give it after --, e.g. assistant run -- torchrun train.py"
        )
    program = command[0]
    if os.sep in program:
        path = Path(cwd or ".") / program if not os.path.isabs(program) else Path(program)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise UserError(f"cannot run {program}: not an executable file")
        return list(command)
    found = shutil.which(program)
    if found is None:
        raise UserError(f"cannot run {program}: not found on PATH")
    return [found, *command[1:]]


# --- the watch loop ------------------------------------------------------------------


class Watch:
    """One launch under watch (see the module docstring)."""

    def __init__(self, command: list[str], options: WatchOptions, on_output: OnOutput | None):
        self.command = list(command)
        self.options = options
        self.program = resolve_command(self.command, options.cwd)  # before any folder is made
        self.log_dir = Path(options.log_dir or default_log_dir()).resolve()
        self.hook_dir = prepare_log_dir(self.log_dir)
        # Held while the job is watched: a run starting meanwhile does not prune this folder.
        self.lock = lock_run_folder(self.log_dir)
        # Only runs that write into the cache prune it; a --log-dir is the person's to manage.
        self.pruned = Pruned() if options.log_dir else prune_old_runs(spare=self.log_dir)
        self.procs = Path(jobhook.procs_dir(str(self.log_dir)))
        self.tail = OutputTail(self.log_dir, on_output, self.log_dir / "output.log")
        self.progress: dict[Path, int] = {}
        self.marked: MarkedProcess | None = None
        self.quiet_seconds: float | None = None  # set when a hang is declared

    def run(self) -> LaunchReport:
        """Run to the end (exit or hang); an interrupt is forwarded, then re-raised."""
        started = time.monotonic()
        try:
            if self.options.on_start is not None:
                self.options.on_start(RunStart(self.log_dir, self.pruned))
            self._start()
            end = self._wait()
            stacks, flight, gpu = {}, {}, []
            if end == "hung":
                stacks = self._take_stacks()
                flight = self._flight_records(stacks)
                gpu = gpu_snapshot(self.log_dir)
            if end == "cancelled":
                self._forward(signal.SIGTERM)
            self.marked.stop()
            self.tail.poll()
            report = self._report(end == "hung", stacks, flight, gpu, time.monotonic() - started)
            report.cancelled = end == "cancelled"
            return report
        except (KeyboardInterrupt, Terminated) as exc:
            self._forward(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else exc.signum)
            exc.log_dir = self.log_dir  # the caller says where the logs are
            raise
        finally:
            if self.marked is not None:
                self.marked.stop()
            self.tail.close()
            if self.lock is not None:
                self.lock.release()

    def _start(self) -> None:
        env = job_environment(
            dict(os.environ if self.options.env is None else self.options.env),
            self.log_dir,
            self.hook_dir,
        )
        with (
            open(self.log_dir / "launch.out", "ab") as out,
            open(self.log_dir / "launch.err", "ab") as err,
        ):
            try:
                self.marked = start_marked(
                    self.program, env=env, cwd=self.options.cwd, stdout=out, stderr=err
                )
            except OSError as exc:
                raise UserError(f"cannot run {self.command[0]}: {exc.strerror or exc}") from None

    def _wait(self) -> str:
        """Until the launch "exited", "hung" (no progress for hang_after s) or was "cancelled"."""
        last_progress = time.monotonic()
        cancel = self.options.cancel
        while self.marked.poll() is None:
            if (cancel is not None and cancel.is_set()) or stop_requested():
                return "cancelled"
            if self.tail.poll() or self._collectives_left():
                last_progress = time.monotonic()
            elif (
                time.monotonic() - last_progress >= self.options.hang_after
                and self._started_python()
            ):
                self.quiet_seconds = time.monotonic() - last_progress
                return "hung"
            time.sleep(POLL_SECONDS)
        return "exited"

    def _started_python(self) -> bool:
        """Whether a Python process of the job is up (srun may wait silently for nodes first)."""
        return any(self.procs.glob("*.json"))

    def _collectives_left(self) -> bool:
        """Whether any rank's main thread left a collective since the last look."""
        moved = False
        for path in self.procs.glob("*.progress"):
            count = progress_count(path)
            if count != self.progress.get(path, 0):
                self.progress[path] = count
                moved = True
        return moved

    def _forward(self, signum: int) -> None:
        """Pass the interrupt to every process of the job; kill what is left after a grace."""
        if self.marked is None:
            return
        for pid in self.marked.pids():
            send(pid, signum)
        deadline = time.monotonic() + FORWARD_GRACE_SECONDS
        while time.monotonic() < deadline and self.marked.pids():
            self.tail.poll()
            time.sleep(POLL_SECONDS)
        self.marked.stop()
        self.tail.poll()

    # -- a hang: stacks without killing ----------------------------------------

    def _take_stacks(self) -> dict[int, list[Frame]]:
        """Every live recorded process's main-thread stack (pid -> frames, innermost first)."""
        records = read_records(self.log_dir)
        targets = [r for r in records.processes.values() if r.stack_signal and is_alive(r.pid)]
        sizes = {r.pid: _size(r.file(self.log_dir, ".stacks")) for r in targets}
        for record in targets:
            send(record.pid, record.stack_signal)
        deadline = time.monotonic() + STACK_WAIT_SECONDS
        while time.monotonic() < deadline:
            if all(_size(r.file(self.log_dir, ".stacks")) > sizes[r.pid] for r in targets):
                time.sleep(0.2)  # let the last thread's lines land
                break
            time.sleep(POLL_SECONDS)
        stacks = {}
        for record in targets:
            text = _read_from(record.file(self.log_dir, ".stacks"), sizes[record.pid])
            thread = main_thread(parse_dump(text), record.main_thread)
            if thread is not None:
                stacks[record.pid] = thread.frames
        return stacks

    def _flight_records(self, stacks: dict[int, list[Frame]]) -> dict[int, LastCollective]:
        """Each live process's last collective, from its flight recorder (pid -> entry)."""
        procs = self.procs
        for pid in stacks:
            (procs / f"{pid}.fr-request").touch()
        deadline = time.monotonic() + FLIGHT_WAIT_SECONDS
        while time.monotonic() < deadline:
            if all((procs / f"{pid}.fr.json").exists() for pid in stacks):
                break
            time.sleep(POLL_SECONDS)
        found = {}
        for pid in stacks:
            entry = last_collective(read_json(procs / f"{pid}.fr.json"))
            if entry is not None:
                found[pid] = entry
        return found

    # -- the report ---------------------------------------------------------------

    def _report(self, hung, stacks, flight, gpu, seconds) -> LaunchReport:
        records = read_records(self.log_dir)
        code = None if hung else exit_status(self.marked.process.returncode)
        ranks = [self._rank(records, r, stacks, hung) for r in records.ranks]
        ranks += [self._rank(records, r, stacks, hung) for r in records.rankless_workers]
        for rank in ranks:
            rank.last_collective = flight.get(rank.pid)
            if rank.waiting_in is None and rank.last_collective is not None:
                rank.waiting_in = rank.last_collective.pending()
        report = LaunchReport(
            self.command, code, hung, self.log_dir, ranks, seconds=seconds, gpu=gpu
        )
        report.flight = compare(
            {r.rank: r.last_collective for r in ranks if r.rank is not None and r.last_collective}
        )
        if hung:
            report.quiet_seconds = self.quiet_seconds
            report.hang = analyse(self._positions(records, ranks, stacks), self.quiet_seconds)
        found = records.root_error()
        if found is not None:
            report.root_error, report.root_text = found
        else:
            report.root_text = self.tail.tail_text()
        link_rank_logs(self.log_dir, records)
        return report

    def _rank(self, records: JobRecords, record: ProcessRecord, stacks, hung) -> RankReport:
        frames = stacks.get(record.pid, [])
        where = innermost_user_frame(frames) if frames else error_frame(record.error)
        return RankReport(
            rank=record.rank,
            local_rank=record.local_rank,
            host=record.host,
            pid=record.pid,
            exit_code=None if hung and record.pid in stacks else records.exit_code(record),
            error=record.error,
            where=where,
            waiting_in=waiting_in(frames) if frames else None,
            stack=frames,
        )

    def _positions(self, records, ranks: list[RankReport], stacks) -> list[RankPosition]:
        positions = []
        for rank in ranks:
            if rank.rank is None:
                continue
            record = records.processes[rank.pid]
            positions.append(
                RankPosition(
                    rank=rank.rank,
                    alive=rank.pid in stacks,
                    where=rank.where,
                    waiting_in=rank.waiting_in,
                    exited_cleanly=record.exited_cleanly,
                )
            )
        return positions


def watch(
    command: list[str], options: WatchOptions | None = None, on_output: OnOutput | None = None
) -> LaunchReport:
    """Run and watch a launch command (no shell); see Watch."""
    return Watch(command, options or WatchOptions(), on_output).run()


# --- small helpers -----------------------------------------------------------------------


def exit_status(returncode: int | None) -> int | None:
    """A Popen return code as a shell shows it: 128 + signal for a killed process."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


def error_frame(error: dict | None) -> Frame | None:
    """Where a rank's exception was raised in the user's own code."""
    if not error:
        return None
    frames = [Frame(f["file"], f["line"], f["function"]) for f in error.get("frames", [])]
    return innermost_user_frame(list(reversed(frames)))


def is_alive(pid: int) -> bool:
    """A live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as source:
            source.seek(offset)
            return source.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def link_rank_logs(log_dir: Path, records: JobRecords) -> None:
    """rank<N>.out / rank<N>.err beside the per-process files, for a person to open."""
    for record in records.ranks:
        for suffix in (".out", ".err"):
            source = record.file(log_dir, suffix)
            target = log_dir / f"rank{record.rank}{suffix}"
            if source.exists() and not target.exists():
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)


def gpu_snapshot(log_dir: Path) -> list[str]:
    """What nvidia-smi shows at a hang (GPU use, the job's processes), when there is one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    queries = (
        ["--query-gpu=index,uuid,utilization.gpu,memory.used", "--format=csv,noheader"],
        ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
    )
    lines = []
    for query in queries:
        try:
            done = subprocess.run(
                [smi, *query], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines += [
            f"nvidia-smi: {line.strip()}" for line in done.stdout.splitlines() if line.strip()
        ]
    (log_dir / "nvidia-smi.txt").write_text("\n".join(lines) + "\n")
    return lines
