"""Running the probes through torchrun, safely: the orchestration.

One launch runs every requested probe (probes/run_probes.py imports them in
the same processes), so `assistant doctor` costs about one bare torchrun
start. Only set_device_order needs more: each of its variants gets a launch
of its own, and only when the first launch found CUDA and NCCL.

Every launch is `<python> -m torch.distributed.run` without a shell, on a
free port, in its own session, under a deadline, with a TMPDIR of its own
inside its temporary folder: what torch, gloo or a probe leaves in a temp
folder goes with the launch, on a signal too. Each probe also has a
budget from the moment it starts; when a probe overruns it, or on cancel,
Ctrl-C, SIGTERM or SIGHUP, every process of the launch is killed. The facts
a hung probe wrote before it hung are kept; probes that had not started yet
get a second launch.

The parts, each small: processes.py (start marked, find, kill),
records.py (reading the ranks' records), outcomes.py (records -> ProbeRun),
machine.py (free port, GPU count), protocol.py (the contract with probes/).
Standard library only (plus assistant.results / config): GPU machines that
run this may lack the assistant's heavier dependencies.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from assistant.config import probes_dir
from assistant.probing import processes
from assistant.probing.machine import free_port, visible_gpu_count
from assistant.probing.outcomes import LaunchEnd, LaunchResult, batch_runs, merge_variants
from assistant.probing.protocol import (
    BATCH_SCRIPT,
    FACTS_DIR_ENV,
    LAUNCHER_PREFIXES,
    LAUNCHER_VARS,
    NPROC_SOURCE_ENV,
    RUNNER_ENV,
    USER_PREFIX,
    VARIANT_ENV,
)
from assistant.probing.records import RecordWatch, log_tail
from assistant.probing.registry import PROBES, ProbeSpec
from assistant.results import ProbeRun

__all__ = [
    "KILL_GRACE_SECONDS",
    "LaunchPlan",
    "ProbeRunner",
    "ProgressEvent",
    "launch_temp",
    "visible_gpu_count",
]

POLL_SECONDS = 0.05
KILL_GRACE_SECONDS = processes.KILL_GRACE_SECONDS


@dataclass
class ProgressEvent:
    """A probe started or finished; elapsed counts seconds since run() began."""

    probe: str
    state: str  # "started" | "finished"
    elapsed: float
    status: str | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """What one torchrun start runs: a script, the probes it covers, its arguments."""

    script: Path
    probes: tuple[str, ...]
    args: tuple[str, ...] = ()
    variant: str | None = None

    @classmethod
    def batch(cls, names: list[str]) -> LaunchPlan:
        """Several probes in one launch (run_probes.py)."""
        return cls(probes_dir() / BATCH_SCRIPT, tuple(names), tuple(names))

    @classmethod
    def for_variant(cls, spec: ProbeSpec, variant: str) -> LaunchPlan:
        """One variant of one probe, in a launch of its own."""
        return cls(spec.script, (spec.name,), ("--variant", variant), variant)


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

        Raises ValueError for an unknown name. On KeyboardInterrupt (or
        processes.Terminated) every process of the launch is killed before
        the interrupt propagates; a signal that arrives in another thread
        stops this run as a cancel does (processes.stop_requested()).
        """
        specs = _specs(names)
        held = {spec.name for spec in specs if spec.variants}  # finished only after the variants
        control = _Control(_Progress(on_progress, held), cancel)
        runs = self._run_batches([spec.name for spec in specs], control)
        for spec in specs:
            if spec.variants and runs[spec.name].status == "ok":  # the preflight says they can run
                runs[spec.name] = self._run_variants(spec, runs[spec.name], control)
        for name in dict.fromkeys(names):
            control.progress.finished(name, runs[name].status)
        return [runs[name] for name in names]

    def _run_batches(self, pending: list[str], control: _Control) -> dict[str, ProbeRun]:
        """The batch launch, and another for the probes a hung probe kept from starting."""
        runs: dict[str, ProbeRun] = {}
        while pending:
            launch = self._launch(LaunchPlan.batch(pending), control)
            batch, pending = batch_runs(launch)
            runs.update(batch)
            for name, run in batch.items():  # those cut short finish here, not after a rerun
                control.progress.report(name, "finished", run.status)
            if launch.end.reason == "cancelled":
                break
        return runs

    def _run_variants(self, spec: ProbeSpec, preflight: ProbeRun, control: _Control) -> ProbeRun:
        """One launch per variant, merged into one ProbeRun with the preflight."""
        if control.cancelled():
            return ProbeRun(
                spec.name,
                "interrupted",
                preflight.seconds,
                preflight.ranks,
                "stopped before its variants ran",
            )
        launches: dict[str, LaunchResult] = {}
        for variant in spec.variants:
            if control.cancelled():
                break
            launch = self._launch(LaunchPlan.for_variant(spec, variant), control)
            launches[variant] = launch
            if launch.end.reason == "cancelled":
                break
        return merge_variants(
            spec.name, spec.variants, preflight, launches, cancelled=control.cancelled()
        )

    def _launch(self, plan: LaunchPlan, control: _Control) -> LaunchResult:
        """Start torchrun once (twice if it lost the race for its port), watch, collect."""
        with processes.tracked_folder("ddp-probes-") as workdir:
            launch = self._start_and_watch(workdir / "1", plan, control)
            if launch.lost_port_race():
                launch = self._start_and_watch(workdir / "2", plan, control)
            return launch

    def _start_and_watch(self, workdir: Path, plan: LaunchPlan, control: _Control) -> LaunchResult:
        facts_dir = workdir / "facts"
        facts_dir.mkdir(parents=True)
        budgets = {name: self._budget(PROBES[name]) for name in plan.probes}
        if control.cancelled():  # stopped before this launch: start nothing
            return LaunchResult(
                list(plan.probes), self.nproc_per_node, LaunchEnd("cancelled"), {}, [], budgets
            )
        log_path = workdir / "launch.log"
        self.launches += 1
        started = time.monotonic()
        watch = RecordWatch(facts_dir, list(plan.probes), self.nproc_per_node)
        with open(log_path, "wb") as log:
            try:
                launch = processes.start_marked(
                    self._command(plan, workdir / "torchelastic"),
                    env=self._launch_env(facts_dir, plan.variant, launch_temp(workdir)),
                    cwd=workdir,
                    stdout=log,
                    stderr=log,
                )
            except OSError as exc:
                tail = [f"cannot start {self.python}: {exc}"]
                return LaunchResult(
                    list(plan.probes), self.nproc_per_node, LaunchEnd("exit", -1), {}, tail, budgets
                )
            try:
                end = self._watch(launch, watch, budgets, control, started)
            finally:  # KeyboardInterrupt, Terminated, a bug: leave nothing running
                launch.stop()
        watch.reread()  # what the ranks wrote between the last look and the kill
        end.seconds = time.monotonic() - started
        return LaunchResult(
            list(plan.probes),
            self.nproc_per_node,
            end,
            watch.records,
            log_tail(log_path),
            budgets,
            dict(watch.first_seen),
            self.timeout,
        )

    def _watch(self, launch, watch: RecordWatch, budgets, control: _Control, started) -> LaunchEnd:
        """Poll until the launch exits, overruns, hangs in a probe, or is cancelled.

        Every way out but "exit" leaves processes behind; the caller's
        launch.stop() kills them. "done" stops a launch early on purpose:
        every record is final, and the interpreters' teardown (seconds) is
        of no use to us.
        """
        deadline = started + self.timeout
        while True:
            code = launch.poll()
            now = time.monotonic()
            for event in watch.update(now):
                control.progress.report(*event)
            if code is not None:
                # Killed from another thread on a signal: a stop, not a crash.
                stopped = control.cancelled() and not watch.all_done()
                return LaunchEnd("cancelled") if stopped else LaunchEnd("exit", code=code)
            if watch.all_done():
                return LaunchEnd("done", code=0)
            if control.cancelled():
                return LaunchEnd("cancelled")
            hung = watch.overdue(budgets, now)
            if hung:
                return LaunchEnd("probe_timeout", hung=hung)
            if now > deadline:
                return LaunchEnd("timeout")
            time.sleep(POLL_SECONDS)

    def _command(self, plan: LaunchPlan, log_dir: Path) -> list[str]:
        """torchrun, on a free port; its logs go into our folder, not a torchelastic_* of /tmp."""
        return [
            self.python,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc_per_node={self.nproc_per_node}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            "--max_restarts=0",
            f"--log_dir={log_dir}",
            str(plan.script),
            *plan.args,
        ]

    def _budget(self, spec: ProbeSpec) -> float:
        budget = min(spec.timeout, self.timeout)
        return min(budget, self.probe_timeout) if self.probe_timeout else budget

    def _user_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        return env

    def probe_env(self, facts_dir: Path, temp: Path) -> dict[str, str]:
        """The environment a probe launch gets (multinode.py starts its own launch).

        temp: the launch's own TMPDIR (launch_temp of its folder).
        """
        return self._launch_env(facts_dir, None, temp)

    def _launch_env(self, facts_dir: Path, variant: str | None, temp: Path) -> dict[str, str]:
        """The user's environment, with torchrun's own variables handed over as PROBE_USER_*."""
        env = self._user_env()
        for key in list(env):
            if key in LAUNCHER_VARS or key.startswith(LAUNCHER_PREFIXES):
                env[USER_PREFIX + key] = env.pop(key)
        env.pop("PYTHONSAFEPATH", None)  # the probes import their helpers from their own folder
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it, with a banner
        env.update(
            {
                RUNNER_ENV: "1",
                FACTS_DIR_ENV: str(facts_dir),
                NPROC_SOURCE_ENV: self.nproc_source,
                "PYTHONUNBUFFERED": "1",
                "TMPDIR": str(temp),
            }
        )
        if variant:
            env[VARIANT_ENV] = variant
        return env


def launch_temp(workdir: Path) -> Path:
    """A launch's own TMPDIR, inside its tracked folder, so it is removed with it.

    gloo's and torch's temp files, anything a probe makes with tempfile: none
    may outlive the launch, not even one ended by SIGKILL after a signal to
    us (torchrun's own log folder is already inside: the launch's --log_dir).
    """
    temp = workdir / "tmp"
    temp.mkdir(exist_ok=True)
    return temp


class _Control:
    """What steers a run from outside: the progress callback and the ways to stop it."""

    def __init__(self, progress: _Progress, cancel: threading.Event | None):
        self.progress = progress
        self.cancel = cancel

    def cancelled(self) -> bool:
        """The caller cancelled, or a signal asked the whole command to stop."""
        return (self.cancel is not None and self.cancel.is_set()) or processes.stop_requested()


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
