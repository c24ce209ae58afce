"""`assistant kb new`, `kb import-thread`, `kb site`: the support team's tools."""

from __future__ import annotations

import re
from pathlib import Path

import click

from assistant.cli.commands import model_option
from assistant.cli.options import team_kb_option
from assistant.errors import UserError

NEAREST = 3  # existing causes shown beside a new one ("is this one of these?")


def target_folder(out: Path | None) -> Path:
    """Where new KB files go: --out, else the first team layer, else the built-in kb/."""
    from assistant.config import kb_dir, team_kb_dirs

    if out is not None:
        return out
    teams = team_kb_dirs()
    return teams[0] if teams else kb_dir()


def read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def make_ranker(model: str | None):
    """The retrieval engine, from `assistant kb`'s factory (tests swap that one)."""
    from assistant.cli import kb as kb_cli

    return kb_cli.make_engine(model)


def existing_cause_file(cause_id: str) -> Path | None:
    """The file already defining `cause_id` in any configured layer, if one does."""
    from assistant.config import kb_layers

    for layer in kb_layers():
        path = layer / "causes" / f"{cause_id}.yaml"
        if path.is_file():
            return path
    return None


out_option = click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    metavar="DIR",
    help="KB folder to write into (default: the first --kb / ASSISTANT_KB_PATH folder, else kb/).",
)


@click.command("new")
@click.argument("cause_id", metavar="ID")
@click.option(
    "--from",
    "report",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="A real report (error, log or question) to scaffold the cause from.",
)
@out_option
@model_option
@team_kb_option
def kb_new(cause_id, report, out, model):
    """Scaffold a new cause file from a real report; `kb lint` fails until its TODOs are written.

    \b
    assistant kb new nccl-bus-clash --from crash.log --kb ../team-kb
    assistant kb new nccl-bus-clash --from crash.log --out ../team-kb
    """
    from assistant.knowledge.scaffold import check_new_id, draft_cause, write_new_file

    check_new_id(cause_id)
    clash = existing_cause_file(cause_id)
    if clash is not None:
        raise UserError(
            f"cause {cause_id!r} already exists ({clash}); to add to it, write a file with "
            f"`extends: {cause_id}` and only the lists to append"
        )
    text = read_text_file(report)
    draft = draft_cause(cause_id, text, source_name=report.name)
    # Asked before the file is written: a scaffold full of TODOs makes the KB invalid.
    nearest = nearest_causes(text, model)
    path = write_new_file(target_folder(out) / "causes" / f"{cause_id}.yaml", draft.yaml)
    click.echo(f"wrote {path}")
    show_root_and_signature(draft)
    show_nearest(nearest)
    click.echo(
        "next: write every TODO, then `assistant kb lint` and `assistant kb eval --by-cause`"
    )


def show_root_and_signature(draft) -> None:
    root = draft.root_error
    click.echo(f"root error: {root.type}: {root.message}" if root else "root error: none found")
    if draft.signature:
        click.echo(f"signature:  {draft.signature}")
        click.echo(f"  matches:  {draft.matched}")
    else:
        click.echo(
            "signature:  none proposed (no exception line); write one if the report has an error line"
        )


def nearest_causes(report: str, model: str | None) -> list:
    """The existing causes retrieval ranks first for the report ([] when it cannot run)."""
    try:
        return make_ranker(model).ask(report, top=NEAREST).causes
    except UserError as exc:  # e.g. another scaffold in the team folder, still full of TODOs
        click.echo(f"nearest causes not shown: {exc}", err=True)
        return []


def show_nearest(causes: list) -> None:
    """Point out the nearest causes the way a duplicate is pointed out."""
    if not causes:
        return
    click.echo("is this one of these? (then extend it instead: `extends: <id>`)")
    for cause in causes:
        click.echo(f"  {cause.id:32} {cause.score:.2f}  {cause.title}")


@click.command("import-thread")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--id", "thread_id", metavar="ID", help="Thread id (default: from the file name).")
@out_option
@model_option
@team_kb_option
def kb_import_thread(file, thread_id, out, model):
    """Turn a forum thread (question, then answers, blank-line separated) into a thread file.

    \b
    assistant kb import-thread thread.txt --id ddp-cant-find-device --kb ../team-kb
    """
    from assistant.knowledge.scaffold import write_new_file
    from assistant.knowledge.threadimport import draft_thread, slug

    thread_id = thread_id or slug(file.stem)
    check_thread_id(thread_id)
    path = target_folder(out) / "threads" / f"{thread_id}.yaml"
    if path.exists():  # checked before retrieval runs, and again by the exclusive write
        raise UserError(f"{path} already exists; not overwriting it (give another --id)")
    draft = draft_thread(read_text_file(file), thread_id, make_ranker(model), source=file.name)
    write_new_file(path, draft.yaml)
    click.echo(f"wrote {path}: {len(draft.answers)} answers")
    for answer in draft.answers:
        claims = ", ".join(f"{c.cause_id} {c.confidence:.2f}" for c in answer.claims) or "-"
        extra = f"  advice={answer.advice}" if answer.advice else ""
        extra += f"  contradicts={','.join(answer.contradicts)}" if answer.contradicts else ""
        click.echo(f"  {answer.id} [{answer.lang}] {claims}{extra}")
    click.echo(
        "next: review claims, advice and contradictions, set each stance, then `assistant kb lint`"
    )


def check_thread_id(thread_id: str) -> None:
    from assistant.knowledge.kb import ID_PATTERN

    if not re.match(ID_PATTERN, thread_id):
        raise UserError(
            f"invalid thread id {thread_id!r}: use lowercase words joined by '-' (--id)"
        )


@click.command("site")
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
@team_kb_option
def kb_site(out):
    """Publish the KB (every layer) as a static website with offline search, English and Chinese.

    \b
    assistant kb site public/ && python -m http.server -d public
    assistant kb site public/ --kb ../team-kb
    """
    from assistant.config import kb_layers
    from assistant.knowledge.kb import load_valid_kb
    from assistant.site.build import build_site

    report = build_site(load_valid_kb(kb_layers()), out)
    click.echo(report.summary())


__all__ = ["kb_import_thread", "kb_new", "kb_site"]
