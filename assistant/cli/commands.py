"""The `assistant` command: thin wrappers over the library.

Heavy modules (torch, sentence-transformers, faiss, textual, rich) are
imported inside the commands that need them, so `assistant --help` and
`assistant kb lint` start in well under a second.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from assistant.cli.options import team_kb_option
from assistant.errors import ExitCode, UserError

BINARY_SHARE = 0.3  # above this share of undecodable/control characters, stdin is binary


class AssistantGroup(click.Group):
    """Turns UserError into one line on stderr and its exit code; Ctrl-C into 130.

    SIGTERM and SIGHUP (timeout, a closed terminal) end a command like
    Ctrl-C: every probe launch killed, temp folders removed (see
    assistant.probing.processes), exit code 128 + signum.
    """

    def invoke(self, ctx):
        from assistant.probing.processes import Terminated, signals_raise

        try:
            with signals_raise():
                return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"assistant: error: {exc}", err=True)
            ctx.exit(int(exc.code))
        except KeyboardInterrupt:
            click.echo("assistant: interrupted", err=True)
            ctx.exit(int(ExitCode.INTERRUPTED))
        except Terminated as exc:
            try:
                click.echo(f"assistant: {exc}", err=True)
            except OSError:
                pass  # SIGHUP: the terminal may be gone
            ctx.exit(exc.exit_code)


@click.group(cls=AssistantGroup, invoke_without_command=True)
@click.version_option(package_name="ddp-assistant")
@click.pass_context
def main(ctx: click.Context) -> None:
    """The assistant for broken PyTorch distributed (DDP) training.

    With no command, opens the chat. Examples:

    \b
        assistant ask "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device"
        torchrun --nproc_per_node=2 train.py 2>&1 | assistant ask -
        assistant doctor
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(chat)


# -- input ---------------------------------------------------------------------


def decode_input(data: bytes) -> str:
    """Bytes from stdin or a file -> text; invalid UTF-8 is replaced, binary refused."""
    text = data.decode("utf-8", errors="replace").replace("\x00", "")
    if not text.strip():
        return ""
    sample = text[:100_000]
    bad = sum(1 for ch in sample if ch == "\ufffd" or (ch < " " and ch not in "\t\n\r\x1b"))
    if bad / len(sample) > BINARY_SHARE:
        raise UserError("the input looks binary, not text: paste the error message or log")
    return text


def read_question(text: str | None, file: Path | None) -> str:
    """The question from an argument, `-` (stdin) or --file."""
    if file is not None and text is not None:
        raise UserError("give the question as an argument or with --file, not both")
    if file is not None:
        try:
            return decode_input(file.read_bytes())
        except OSError as exc:
            raise UserError(f"cannot read {file}: {exc.strerror}") from None
    if text == "-" or (text is None and not sys.stdin.isatty()):
        return decode_input(sys.stdin.buffer.read())
    return text or ""


def _engine(model: str | None):
    from assistant.knowledge.engine import Engine

    return Engine(model=model)


def _runner(python: str | None, nproc: int | None, timeout: float):
    from assistant.probing.runner import ProbeRunner

    try:
        return ProbeRunner(python=python, nproc_per_node=nproc, timeout=timeout)
    except ValueError as exc:  # --python names no interpreter
        raise UserError(f"--python: {exc}") from None


def _console():
    from rich.console import Console

    return Console(soft_wrap=False)


# -- ask -------------------------------------------------------------------------

model_option = click.option(
    "--model",
    metavar="PATH",
    help="Local sentence-transformers model directory (default: bundled all-MiniLM-L6-v2; "
    "env ASSISTANT_MODEL).",
)
probe_options = [
    click.option(
        "--python", "python_path", metavar="PATH", help="Python of your training environment."
    ),
    click.option("--nproc-per-node", type=click.IntRange(1, 64), help="Ranks per probe launch."),
    click.option(
        "--probe-timeout",
        type=click.FloatRange(1, 3600),
        default=60.0,
        show_default=True,
        help="Seconds before a probe launch is killed.",
    ),
]


def with_probe_options(func):
    for option in reversed(probe_options):
        func = option(func)
    return func


@main.command()
@click.argument("text", required=False)
@click.option(
    "--file",
    "file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Read the question from a file.",
)
@click.option("--top", type=int, default=5, show_default=True, help="How many causes to show.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the JSON contract (README: the --json contract)."
)
@click.option("--full", is_flag=True, help="Every cause in full (default: the first in full).")
@click.option(
    "--batch",
    type=click.Path(path_type=Path, dir_okay=False),
    help="JSON lines {id, query} in; one JSON result per line out.",
)
@click.option("--no-probe", is_flag=True, help="Retrieval only: do not run probes.")
@click.option(
    "--script", type=click.Path(path_type=Path), help="Your training script, checked statically."
)
@click.option(
    "--after",
    metavar="ANSWER_ID",
    help="Read the text as your reply to that answer (what it asked for): re-ranks both together.",
)
@model_option
@team_kb_option
@with_probe_options
def ask(
    text,
    file,
    top,
    as_json,
    full,
    batch,
    no_probe,
    script,
    after,
    model,
    python_path,
    nproc_per_node,
    probe_timeout,
):
    """Explain an error or a log and rank its likely causes.

    \b
    assistant ask "RuntimeError: Default process group has not been initialized"
    torchrun --nproc_per_node=2 train.py 2>&1 | assistant ask -
    assistant ask --json --no-probe "DDP 一直报错找不到设备"
    assistant ask --after 3f2a9c01d4e5 "nvidia-smi shows both ranks on GPU 0"
    """
    if not 1 <= top <= 50:
        raise UserError("--top must be between 1 and 50")
    if after is not None and batch is not None:
        raise UserError("--after reads one reply; it cannot go with --batch")
    findings = _lint_findings(script)
    runner = None if no_probe else _runner(python_path, nproc_per_node, probe_timeout)
    pipeline = _pipeline(_engine(model), runner)
    if batch is not None:
        _ask_batch(pipeline, batch, top, findings, script is not None)
        return
    text = read_question(text, file)
    if not text.strip():
        raise UserError("the question is empty: give an error message, a log, or `-` for stdin")
    from assistant.pipeline import Question

    question = Question(text, top=top, findings=findings, script_checked=script is not None)
    earlier_turns = 0
    if after is not None:
        question, earlier_turns = as_reply(pipeline, question, after)
    with probe_status(runner is not None and not as_json) as observer:
        result = pipeline.ask(question, observer)
    if as_json:
        click.echo(json.dumps(result.to_json(), ensure_ascii=False, indent=2))
        return
    from assistant.cli.render import render_result, word

    console = _console()
    if after is not None:  # the ranking rests on the thread too: say so first
        line = word("read_as_reply", result.lang, id=after, count=earlier_turns)
        console.print(line, style="dim", markup=False, highlight=False)
    if script is not None and not findings:  # checked, and clean: silence would read as unchecked
        line = word("script_clean", result.lang, path=script)
        console.print(line, style="dim", markup=False, highlight=False)
    render_result(result, console, full=full)


def as_reply(pipeline, question, answer_id: str):
    """`question` as the chat asks a reply: in the conversation of a kept answer
    (and how many earlier questions that conversation has).

    The thread's questions (the kept answer's, and those it replied to) go
    through the same flow again, oldest first, each as the chat asks a
    follow-up, without probes (their verdicts rest on the text and the script)
    and without being kept a second time; they become a real Conversation's
    turns, so the reply carries exactly what the chat gives a follow-up (the
    question that asked what would decide and its causes, the root error).
    """

    from assistant.chat.conversation import Conversation, Turn
    from assistant.pipeline import Pipeline

    replay = Pipeline(engine=pipeline.engine)
    conversation = Conversation()
    for earlier_text in pipeline.answers.thread_of(answer_id):
        earlier = replay.ask(in_conversation(question, conversation, earlier_text, probe=False))
        conversation.add(Turn(query=earlier_text, result=earlier))
    reply = in_conversation(question, conversation, question.text, after=answer_id)
    return reply, len(conversation.turns)


def in_conversation(question, conversation, text: str, **changes):
    """`question` with `text`, asked as the conversation's next turn."""
    from dataclasses import replace

    return replace(
        question,
        text=text,
        **conversation.follow_up(),
        **changes,
    )


def _lint_findings(script: Path | None) -> list:
    if script is None:
        return []
    from assistant.lint import lint_script

    return lint_script(script)


def _pipeline(engine, runner):
    from assistant.config import feedback_path
    from assistant.feedback import FeedbackStore
    from assistant.pipeline import Pipeline

    answers = FeedbackStore(feedback_path()) if engine is not None else None
    return Pipeline(engine=engine, runner=runner, answers=answers)


@contextmanager
def probe_status(show: bool):
    """The pipeline's observer; on a terminal it shows which probe runs, and for how long."""
    from assistant.pipeline import Observer

    if not show or not sys.stderr.isatty():
        yield Observer()
        return
    from rich.console import Console

    with Console(stderr=True).status("running probes…") as status:
        yield Observer(
            on_probe=lambda e: status.update(f"probe {e.probe}: {e.state} ({e.elapsed:.1f}s)")
        )


def _ask_batch(pipeline, batch: Path, top: int, findings, script_checked: bool) -> None:
    """One contract object per input line, in order, each with its id."""
    try:
        lines = batch.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read --batch file {batch}: {exc.strerror}") from None
    items = [
        _batch_item(batch, number, line) for number, line in enumerate(lines, 1) if line.strip()
    ]
    from assistant.pipeline import Question

    known_runs: list = []  # this machine's facts do not change between lines: probe once
    for item_id, query in items:
        try:
            result = pipeline.ask(
                Question(
                    query,
                    top=top,
                    findings=findings,
                    script_checked=script_checked,
                    known_runs=known_runs,
                )
            )
            known_runs = known_runs or list(result.probes)
            payload = {"id": item_id, **result.to_json()}
        except UserError as exc:
            payload = {"id": item_id, "error": str(exc)}
        click.echo(json.dumps(payload, ensure_ascii=False))


def _batch_item(batch: Path, number: int, line: str) -> tuple:
    try:
        item = json.loads(line)
        return item["id"], str(item["query"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f'{batch}:{number}: expected a JSON object with "id" and "query"') from None


# -- scripts and probes ---------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract with query null.")
@click.option("--lang", type=click.Choice(["en", "zh"]), default="en", show_default=True)
@team_kb_option
@with_probe_options
@click.option("--nnodes", type=click.IntRange(1, 4096), help="Nodes of the job (multi-node check).")
@click.option("--node-rank", type=click.IntRange(0, 4095), help="This node's rank, 0..nnodes-1.")
@click.option("--master-addr", metavar="HOST", help="The job's master address.")
@click.option("--master-port", type=click.IntRange(1, 65535), help="The job's master port (29500).")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="The job's c10d rendezvous endpoint.")
@click.option("--slurm", is_flag=True, help="Nodes and this node's rank from SLURM_* (under srun).")
@click.option(
    "--local-addr", metavar="HOST", help="torchrun's --local-addr, if the job passes one."
)
@click.option(
    "--join-timeout",
    type=click.FloatRange(1, 3600),
    default=60.0,
    show_default=True,
    help="Seconds the nodes wait for each other before naming the missing ones.",
)
@click.option("--nodes-only", is_flag=True, help="Multi-node: skip this node's own probes.")
@click.option(
    "--storage-dir",
    metavar="DIR",
    help="Multi-node: the folder checked for being shared by the nodes (the job's output or "
    "checkpoint folder; default: the current folder).",
)
def doctor(as_json, lang, python_path, nproc_per_node, probe_timeout, **nodes):
    """Run every probe on this machine and judge every cause; with --nnodes, across nodes.

    Multi-node: run it on every node with the job's own arguments; the nodes
    meet in torchrun's c10d rendezvous, exchange their facts, and each
    prints them side by side with the cross-node verdicts.

    \b
    assistant doctor
    assistant doctor --json --nproc-per-node 2
    assistant doctor --nnodes 2 --node-rank 0 --master-addr node-1 --master-port 29500
    srun --ntasks-per-node=1 assistant doctor --slurm --storage-dir ./checkpoints
    """
    import os

    from assistant.probing.multinode import NodesRunner, plan_from_options

    nodes_only = nodes.pop("nodes_only")
    plan = plan_from_options(os.environ, nproc_per_node=nproc_per_node, **nodes)
    runner = _runner(python_path, nproc_per_node, probe_timeout)
    if plan is not None:
        runner = NodesRunner(runner, plan, local=not nodes_only)
    pipeline = _pipeline(None, runner)
    with probe_status(not as_json) as observer:
        result = pipeline.doctor(lang=lang, observer=observer)
    if as_json:
        click.echo(json.dumps(result.to_json(), ensure_ascii=False, indent=2))
    else:
        from assistant.cli.render import render_machine_check

        render_machine_check(result, _console())
    if result.nodes_problem:
        raise UserError(result.nodes_problem, ExitCode.FAILED)


@main.command()
@click.argument("names", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print every rank's facts as JSON.")
@with_probe_options
def probe(names, as_json, python_path, nproc_per_node, probe_timeout):
    """Run chosen registered probes and print their facts.

    \b
    assistant probe devices rendezvous
    """
    from assistant.probing.registry import PROBES

    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise UserError(f"unknown probe {', '.join(unknown)} (known: {', '.join(PROBES)})")
    pipeline = _pipeline(None, _runner(python_path, nproc_per_node, probe_timeout))
    runs = pipeline.run_named(names)
    if as_json:
        payload = [{**r.to_json(), "detail": r.detail, "ranks": r.ranks} for r in runs]
        click.echo(json.dumps(payload, indent=2, ensure_ascii=False))
        return
    for run in runs:
        click.echo(f"{run.name}: {run.status} ({run.seconds:.1f}s) {run.detail}")


# -- chat -------------------------------------------------------------------------------


@main.command()
@model_option
@team_kb_option
@click.option(
    "--lang",
    type=click.Choice(["en", "zh"]),
    help="Interface language (default: follows the question).",
)
@click.option(
    "--no-history",
    is_flag=True,
    help="Keep nothing of this chat on disk (also ASSISTANT_NO_HISTORY=1).",
)
def chat(model, lang, no_history):
    """Open the terminal chat (the default command).

    \b
    assistant chat
    assistant chat --no-history      # pasted logs stay in memory only
    """
    from assistant.tui.app import run_chat

    run_chat(model=model, lang=lang, keep_history=not no_history)


if __name__ == "__main__":
    main()
