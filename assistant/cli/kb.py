"""`assistant kb`: maintain the knowledge base (lint, build, stats, eval)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from assistant.cli.commands import model_option
from assistant.cli.options import team_kb_option
from assistant.errors import ExitCode, UserError


def make_engine(model: str | None):
    """The engine over the configured KB (imported late: it pulls in the model stack)."""
    from assistant.knowledge.engine import Engine

    return Engine(model=model)


@click.group()
def kb() -> None:
    """Maintain the knowledge base: lint, build, stats, eval.

    \b
    assistant kb lint && assistant kb build && assistant kb eval
    """


@kb.command("lint")
@team_kb_option
def kb_lint():
    """Validate every KB file of every layer; exit 1 naming file and field for each problem.

    \b
    assistant kb lint
    assistant kb lint --kb ../team-kb
    """
    from assistant.config import kb_layers
    from assistant.knowledge.kb import KBError, load_kb

    layers = kb_layers()
    try:
        kb = load_kb(layers)
    except KBError as exc:
        for problem in exc.problems:
            click.echo(problem, err=True)
        where = " + ".join(str(layer) for layer in layers)
        click.echo(f"{len(exc.problems)} problem(s) in {where}", err=True)
        sys.exit(int(ExitCode.FAILED))
    answers = sum(len(t.answers) for t in kb.threads)
    extended = f", {len(kb.extended_by)} extended" if kb.extended_by else ""
    click.echo(
        f"ok: {len(kb.causes)} causes{extended}, {len(kb.threads)} threads, {answers} answers"
    )


@kb.command("build")
@model_option
@team_kb_option
def kb_build(model):
    """Compile kb/ into the SQLite + FAISS index (re-embeds only what changed).

    \b
    assistant kb build
    """
    engine = make_engine(model)
    click.echo(engine.build().summary())


@kb.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@team_kb_option
def kb_stats(as_json):
    """Per cause: titles, signatures, answers, probes and the layer it came from.

    \b
    assistant kb stats --json
    assistant kb stats --kb ../team-kb
    """
    from assistant.config import kb_layers
    from assistant.knowledge.kb import KBError, load_kb
    from assistant.knowledge.stats import kb_stats as compute

    try:
        stats = compute(load_kb(kb_layers()))
    except KBError as exc:
        raise UserError(f"knowledge base is invalid: {exc.problems[0]}", ExitCode.FAILED) from None
    if as_json:
        click.echo(json.dumps(stats, ensure_ascii=False, indent=2))
        return
    for row in stats["causes"]:
        click.echo(
            f"{row['id']:32} sig={row['signatures']:<2} answers={row['answers']:<2} "
            f"probes={','.join(row['probes']) or '-'}"
        )
    click.echo(json.dumps(stats["totals"]))


@kb.command("eval")
@click.argument("file", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--floor", type=float, help="Exit 1 when fused top-1 is below this fraction.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@model_option
def kb_eval(file, floor, as_json, model):
    """Top-1, recall@3 and MRR on labelled queries, fused and per signal.

    \b
    assistant kb eval                      # data/eval/queries.jsonl
    assistant kb eval my_queries.jsonl --floor 0.6
    """
    from assistant.config import eval_dir
    from assistant.knowledge.evaluate import evaluate, format_report, load_queries

    queries = load_queries(file or eval_dir() / "queries.jsonl")
    report = evaluate(make_engine(model), queries)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    if floor is not None and report["fused"]["top1"] < floor:
        click.echo(
            f"fused top-1 {report['fused']['top1']:.3f} is below the floor {floor}", err=True
        )
        sys.exit(int(ExitCode.FAILED))
