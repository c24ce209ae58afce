"""Run a launch, watch it, and answer for it: the headless API of `assistant run` and the chat.

    outcome = run_and_diagnose(
        ["torchrun", "--nproc_per_node=2", "train.py"],
        RunOptions(hang_after=600, probe=True),
        engine=Engine(),
        callbacks=RunCallbacks(on_output=..., on_launch=..., on_result=...),
    )
    outcome.launch      # LaunchReport: exit code, hung, log folder, ranks, root error, hang
    outcome.result      # the pipeline's Result for a failure or a hang (None on success)
    outcome.to_json()   # the `ask` contract plus "launch" and "ranks"

`cancel` (a threading.Event) ends the job from another thread, as Ctrl-C
would: the outcome then has launch.cancelled and no answer.
Callbacks run in the calling thread (the chat calls this from a worker):
on_start(RunStart) once the log folder is ready, before the job starts
(where the logs go, what pruning old run folders did), on_output(stream,
bytes) for every piece of output as the job writes it, on_launch(LaunchReport)
once the job has ended (the diagnosis follows), on_probe(event) for each
probe, on_result(RunOutcome) at the end.

After a failure the question is the root error's own traceback (from the
ranks' records), the root error is passed as known, the script named in the
command is linted, and the probes run with the job's interpreter, ranks per
node and environment. After a hang the question is the hang's summary and
each named rank's position is a finding (source "probe") for its cause.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from assistant.results import Finding, Result
from assistant.watch.launch import interpreter_of, nproc_of, probe_environment, script_of
from assistant.watch.output import OnOutput
from assistant.watch.watcher import (
    DEFAULT_HANG_AFTER,
    LaunchReport,
    RunStart,
    WatchOptions,
    watch,
)

# A probe launch for `run` gets this long; the user's job already showed its start-up cost.
PROBE_TIMEOUT = 60.0


@dataclass
class RunOptions:
    """What `assistant run` was asked for."""

    hang_after: float = DEFAULT_HANG_AFTER
    log_dir: Path | None = None
    probe: bool = True
    top: int = 5
    cwd: Path | None = None
    env: dict[str, str] | None = None  # None: this process's environment
    probe_timeout: float = PROBE_TIMEOUT


@dataclass
class RunOutcome:
    """The watched launch and, when it failed or hung, the answer for it."""

    launch: LaunchReport
    result: Result | None
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict:
        """The `ask` contract (query null on success) plus `launch` and `ranks`."""
        result = self.result or Result(query=None, root_error=None, causes=[])
        return {
            **result.to_json(),
            "launch": self.launch.launch_json(),
            "ranks": self.launch.ranks_json(),
        }


@dataclass
class RunCallbacks:
    """Optional callbacks of one run (see the module docstring)."""

    on_output: OnOutput | None = None
    on_launch: Callable[[LaunchReport], None] | None = None
    on_probe: Callable[[object], None] | None = None
    on_result: Callable[[RunOutcome], None] | None = None
    on_start: Callable[[RunStart], None] | None = None


def run_and_diagnose(
    command: list[str],
    options: RunOptions | None = None,
    engine=None,
    callbacks: RunCallbacks | None = None,
    cancel: threading.Event | None = None,
) -> RunOutcome:
    """Run the launch; on a failure or a hang, answer for it with the pipeline.

    engine: the knowledge side (assistant.knowledge.engine.Engine); it is
    only used when the launch fails or hangs. Raises UserError for a
    command that cannot start; KeyboardInterrupt / Terminated go on after
    the job was stopped.
    """
    options = options or RunOptions()
    callbacks = callbacks or RunCallbacks()
    launch = watch(
        command,
        WatchOptions(
            options.hang_after,
            options.log_dir,
            options.cwd,
            options.env,
            cancel,
            on_start=callbacks.on_start,
        ),
        callbacks.on_output,
    )
    if callbacks.on_launch is not None:
        callbacks.on_launch(launch)
    outcome = RunOutcome(launch, None)
    if launch.failed and engine is not None:
        outcome = diagnose(launch, options, engine, callbacks, cancel)
    if callbacks.on_result is not None:
        callbacks.on_result(outcome)
    return outcome


def diagnose(
    launch: LaunchReport,
    options: RunOptions,
    engine,
    callbacks: RunCallbacks | None = None,
    cancel: threading.Event | None = None,
    runner=None,
) -> RunOutcome:
    """The pipeline's answer for a failed or hung launch.

    runner: what runs the probes (default: probe_runner, launched as the
    user launched); a launch recorded elsewhere is answered with the
    probe facts recorded on its machine.
    """
    from assistant.pipeline import Observer, Pipeline, Question

    callbacks = callbacks or RunCallbacks()
    linted = script_findings(launch.command, options.cwd)
    findings = linted or []
    if launch.hang is not None:
        findings = list(launch.hang.findings) + findings
    pipeline = Pipeline(engine=engine, runner=runner or probe_runner(launch, options))
    question = Question(
        question_text(launch),
        top=options.top,
        findings=findings,
        script_checked=linted is not None,
        root_error=launch.root_error,
        probe=options.probe,
    )
    try:
        result = pipeline.ask(question, Observer(on_probe=callbacks.on_probe), cancel)
    finally:
        pipeline.close()
    return RunOutcome(launch, result, findings)


def question_text(launch: LaunchReport) -> str:
    """What to ask: the hang's summary, the root traceback, or the output's last lines."""
    if launch.hang is not None:
        lines = [f"The job hangs: {launch.hang.summary}."]
        lines += [finding.message for finding in launch.hang.findings]
        lines += launch.flight
        return "\n".join(lines)
    text = launch.root_text.strip()
    if text:
        return text
    return f"the launch exited with code {launch.exit_code} and printed nothing"


def script_findings(command: list[str], cwd: Path | None) -> list[Finding] | None:
    """`assistant lint` of the script the command names; None when no script was linted."""
    from assistant.errors import UserError
    from assistant.lint import lint_script

    script = script_of(command, cwd)
    if script is None:
        return None
    try:
        return list(lint_script(script))
    except UserError:
        return None  # a script lint cannot read is the job's problem, already reported


def probe_runner(launch: LaunchReport, options: RunOptions):
    """Probes launched as the user launched: same Python, ranks per node, environment."""
    if not options.probe:
        return None
    from assistant.probing.runner import ProbeRunner

    environ = dict(os.environ if options.env is None else options.env)
    ranks_here = len([r for r in launch.ranks if r.rank is not None]) or None
    return ProbeRunner(
        python=interpreter_of(launch.command),
        nproc_per_node=nproc_of(launch.command) or ranks_here,
        timeout=options.probe_timeout,
        env=probe_environment(environ),
    )
