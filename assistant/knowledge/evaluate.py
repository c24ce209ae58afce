"""Retrieval quality on labelled queries: top-1, recall@3 and MRR.

Measured for the fused ranking and for each signal alone, so a change to one
signal shows what it does to the whole.
"""

from __future__ import annotations

import json
from pathlib import Path

from assistant.errors import UserError
from assistant.knowledge.retrieve import SIGNALS, fuse, with_shortcut

RUNS = {"fused": SIGNALS, **{name: (name,) for name in SIGNALS}}


def load_queries(path: Path) -> list[dict]:
    """Labelled queries: JSON lines with id, query and causes (best first)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    queries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            queries.append(
                {"id": item["id"], "query": item["query"], "causes": list(item["causes"])}
            )
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{number}: expected JSON with id, query and causes") from None
    if not queries:
        raise UserError(f"{path}: no queries")
    return queries


def score_ranking(ranked: list[str], relevant: list[str]) -> dict[str, float]:
    """top1: the first result is relevant; recall3: a relevant one in the top 3; rr: 1/rank."""
    wanted = set(relevant)
    first = next((i for i, cid in enumerate(ranked, 1) if cid in wanted), None)
    return {
        "top1": float(first == 1),
        "recall3": float(first is not None and first <= 3),
        "mrr": 1.0 / first if first else 0.0,
    }


def evaluate(engine, queries: list[dict]) -> dict:
    """Metrics per run (fused and each signal), plus the misses of the fused run."""
    report: dict = {"queries": len(queries)}
    misses = []
    # Signals are independent: compute each once per query, fuse per run.
    per_query = [engine.signal_scores(item["query"]) for item in queries]
    for run, signals in RUNS.items():
        totals = {"top1": 0.0, "recall3": 0.0, "mrr": 0.0}
        for item, per_signal in zip(queries, per_query):
            chosen = {s: per_signal[s] for s in signals}
            if run == "fused":
                chosen = with_shortcut(chosen)  # exactly what `ask` fuses
            ranked = [r.id for r in fuse(chosen)]
            scores = score_ranking(ranked, item["causes"])
            for key in totals:
                totals[key] += scores[key]
            if run == "fused" and not scores["top1"]:
                misses.append({"id": item["id"], "want": item["causes"], "got": ranked[:3]})
        report[run] = {key: round(value / len(queries), 4) for key, value in totals.items()}
    report["misses"] = misses
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['queries']} queries", f"{'run':10} {'top1':>6} {'recall@3':>9} {'MRR':>6}"]
    for run in RUNS:
        m = report[run]
        lines.append(f"{run:10} {m['top1']:6.3f} {m['recall3']:9.3f} {m['mrr']:6.3f}")
    if report["misses"]:
        lines.append(f"fused misses ({len(report['misses'])}):")
        lines += [f"  {m['id']}: want {m['want']} got {m['got']}" for m in report["misses"]]
    return "\n".join(lines)
