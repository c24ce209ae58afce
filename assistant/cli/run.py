"""`assistant run -- COMMAND ...`: run the user's launch, and answer for it when it fails or hangs.

A thin layer over assistant.watch.session: it streams the job's output
unchanged, then prints the ranks (exception, or where each one stood in a
hang) and the answer, and exits with the job's own exit code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from assistant.cli.options import team_kb_option
from assistant.errors import ExitCode

HANG_AFTER_DEFAULT = 600.0


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--hang-after",
    type=click.FloatRange(1, 86400),
    default=HANG_AFTER_DEFAULT,
    show_default=True,
    metavar="SECONDS",
    help="A hang: no output and no rank leaving a collective for this long.",
)
@click.option("--no-probe", is_flag=True, help="Do not run probes after a failure.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the JSON contract plus launch and ranks."
)
@click.option(
    "--log-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Keep every rank's output and records here (default: a new folder in your cache).",
)
@click.option(
    "--top", type=click.IntRange(1, 50), default=5, show_default=True, help="How many causes."
)
@click.option("--model", metavar="PATH", help="Local sentence-transformers model directory.")
@team_kb_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(hang_after, no_probe, as_json, log_dir, top, model, command):
    """Run your launch command, watch it, and diagnose a failure or a hang.

    The command runs without a shell; its output streams unchanged (to
    stderr with --json). On a failure: the ranks' own exceptions, the
    answer for the root error, lint of the script, probes launched like
    yours. On a hang: every rank's stack, the rank(s) not where the others
    wait, and the cause. Exit code: the command's; 124 after a hang.

    \b
    assistant run -- torchrun --nproc_per_node=2 train.py
    assistant run --hang-after 120 --json -- python -m torch.distributed.run --nproc_per_node 4 train.py
    """
    from assistant.watch.session import RunCallbacks, RunOptions, run_and_diagnose

    options = RunOptions(hang_after=hang_after, log_dir=log_dir, probe=not no_probe, top=top)
    callbacks = RunCallbacks(
        on_output=stream_output(as_json),
        on_launch=lambda r: announce(r, as_json),
        on_start=announce_start,
    )
    from assistant.knowledge.engine import Engine  # loads its index only when asked

    try:
        outcome = run_and_diagnose(list(command), options, Engine(model=model), callbacks)
    except BaseException as exc:  # the log folder is worth reading after a stop too
        _note_logs_on_stop(exc)
        raise
    if as_json:
        click.echo(json.dumps(outcome.to_json(), ensure_ascii=False, indent=2))
    else:
        print_outcome(outcome)
    sys.exit(exit_code(outcome.launch))


def stream_output(as_json: bool):
    """The job's bytes, unchanged, to our stdout/stderr (all to stderr under --json)."""

    def write(stream: str, data: bytes) -> None:
        target = sys.stderr if as_json or stream == "stderr" else sys.stdout
        target.buffer.write(data)
        target.flush()

    return write


def announce_start(start) -> None:
    """Where this run's logs go, before its output; one line more if old logs could not go."""
    click.echo(f"assistant run: logs in {start.log_dir}", err=True)
    if start.pruned.problem:
        click.echo(f"assistant run: {start.pruned.problem}", err=True)


def announce(launch, as_json: bool) -> None:
    """One line once the job is over, before the (slower) diagnosis."""
    if as_json:
        return
    if launch.hung:
        state = f"hung (no progress for {launch.quiet_seconds:.0f} s) and was ended"
    else:
        state = f"exited with code {launch.exit_code} after {launch.seconds:.1f} s"
    click.echo(f"assistant run: the job {state}; logs in {launch.log_dir}", err=True)


def exit_code(launch) -> int:
    """The command's own exit code; 124 when it hung and was ended."""
    if launch.hung:
        return int(ExitCode.HUNG)
    return launch.exit_code if launch.exit_code is not None else int(ExitCode.FAILED)


def print_outcome(outcome) -> None:
    """The ranks, the hang's diagnosis, then the answer (rich)."""
    from rich.console import Console

    launch = outcome.launch
    if not launch.failed:
        return
    console = Console(soft_wrap=False)
    console.rule("assistant run")
    for rank in launch.ranks:
        console.print(rank.summary(), markup=False, highlight=False)
    if launch.hang is not None:
        console.print(f"hang: {launch.hang.summary}", markup=False, highlight=False, style="bold")
    for line in launch.flight + launch.gpu:
        console.print(line, markup=False, highlight=False)
    if outcome.result is not None:
        from assistant.cli.render import render_result

        render_result(outcome.result, console)
    console.print(f"logs: {launch.log_dir}", markup=False, highlight=False)


def _note_logs_on_stop(exc: BaseException) -> None:
    folder = getattr(exc, "log_dir", None)
    if folder:
        click.echo(f"assistant run: logs in {folder}", err=True)
