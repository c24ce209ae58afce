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
    from assistant.knowledge.bridges import BRIDGE_FILE, read_bridge_file
    from assistant.knowledge.kb import KBError, load_kb

    layers = kb_layers()
    problems = []
    try:
        kb = load_kb(layers)
    except KBError as exc:
        problems = list(exc.problems)
    for layer in layers:  # each layer's term bridge, checked before it reaches a query
        try:
            read_bridge_file(Path(layer) / BRIDGE_FILE)
        except UserError as exc:
            problems.append(str(exc))
    if problems:
        for problem in problems:
            click.echo(problem, err=True)
        where = " + ".join(str(layer) for layer in layers)
        click.echo(f"{len(problems)} problem(s) in {where}", err=True)
        sys.exit(int(ExitCode.FAILED))
    answers = sum(len(t.answers) for t in kb.threads)
    extended = f", {len(kb.extended_by)} extended" if kb.extended_by else ""
    click.echo(
        f"ok: {len(kb.causes)} causes{extended}, {len(kb.threads)} threads, {answers} answers"
    )


@kb.command("build")
@model_option
@team_kb_option
@click.option(
    "--ship-vectors",
    is_flag=True,
    help="Also write every embedded text's vector to data/eval/vectors.npz, "
    "so a fresh clone embeds only texts added after it (maintainers).",
)
def kb_build(model, ship_vectors):
    """Compile kb/ into the SQLite + FAISS index (re-embeds only what changed).

    \b
    assistant kb build
    assistant kb build --ship-vectors
    """
    engine = make_engine(model)
    click.echo(engine.build().summary())
    if ship_vectors:
        path, count = engine.ship_vectors()
        click.echo(f"wrote {count} vectors to {path}")


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
    from assistant.knowledge.kb import load_valid_kb
    from assistant.knowledge.stats import kb_stats as compute

    stats = compute(load_valid_kb(kb_layers()))
    if as_json:
        click.echo(json.dumps(stats, ensure_ascii=False, indent=2))
        return
    builtin = str(kb_layers()[0])
    for row in stats["causes"]:
        layers = [] if row["source"] == builtin else [f"from={row['source']}"]
        layers += [f"extended-by={layer}" for layer in row["extended_by"]]
        click.echo(
            f"{row['id']:32} sig={row['signatures']:<2} answers={row['answers']:<2} "
            f"probes={','.join(row['probes']) or '-'} {' '.join(layers)}".rstrip()
        )
    click.echo(json.dumps(stats["totals"]))


@kb.command("eval")
@click.argument("files", nargs=-1, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--floor", type=float, help="Exit 1 when fused top-1 is below this fraction.")
@click.option("--by-cause", is_flag=True, help="Recall per cause, and which cause is taken for it.")
@click.option(
    "--compare",
    "revision",
    metavar="REV",
    help="Query by query against the KB at git revision REV: fixed, broken, unchanged.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@model_option
@team_kb_option
def kb_eval(files, floor, by_cause, revision, as_json, model):
    """Top-1, recall@3 and MRR on labelled queries, fused and per signal.

    Several files are pooled (the figures cover them all) and each one's own
    fused figures are listed too.

    \b
    assistant kb eval                      # data/eval/queries.jsonl
    assistant kb eval my_queries.jsonl --floor 0.6
    assistant kb eval data/eval/real_reports*.jsonl   # pooled, and per file
    assistant kb eval --by-cause           # which causes are missed, and for what
    assistant kb eval --compare main       # what this change fixes and breaks
    """
    from assistant.knowledge import evaluate as ev

    queries = ev.load_query_sets(list(files) or [default_queries()])
    engine = make_engine(model)
    if revision:
        from assistant.knowledge.revision import compare_to_revision

        # The working tree's rankings, computed once.
        rankings = ev.fused_rankings(ev.all_signal_scores(engine, queries))
        report = compare_to_revision(engine, queries, revision, rankings, log=_stderr)
        top1 = report["after"]["top1"]
        text = ev.format_comparison(report)
    else:
        # One pass, each file held out once, for the rankings and the confidence.
        answers = ev.answer_queries(engine, queries)
        rankings = ev.fused_rankings(answers.scores)
        report = ev.report_of(queries, answers, rankings)
        top1 = report["fused"]["top1"]
        text = ev.format_report(report)
    if len(files) > 1:
        report["by_set"] = ev.by_set(queries, rankings)
        text += "\n" + ev.format_by_set(report["by_set"])
    if by_cause:
        rows = ev.by_cause(queries, rankings)
        report["by_cause"] = rows
        text += "\n" + ev.format_by_cause(rows)
    click.echo(json.dumps(report, indent=2, ensure_ascii=False) if as_json else text)
    if floor is not None and top1 < floor:
        click.echo(f"fused top-1 {top1:.3f} is below the floor {floor}", err=True)
        sys.exit(int(ExitCode.FAILED))


def _stderr(message: str) -> None:
    click.echo(message, err=True)


def default_queries() -> Path:
    """The built-in labelled set (in the checkout, and shipped in the wheel)."""
    from assistant.config import eval_dir

    path = eval_dir() / "queries.jsonl"
    if not path.is_file():
        raise UserError(
            f"no labelled queries at {path} (this installation lacks the eval set): "
            "give a file, e.g. `assistant kb eval my_queries.jsonl`"
        )
    return path
