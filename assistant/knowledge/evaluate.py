"""Retrieval quality on labelled queries: top-1, recall@3 and MRR.

Measured for the fused ranking and for each signal alone, so a change to one
signal shows what it does to the whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from assistant.errors import UserError
from assistant.knowledge.retrieve import SIGNALS, fuse, with_shortcut

if TYPE_CHECKING:
    from assistant.results import Result

TurnPair = tuple[dict, "Result", "Result"]  # (labelled query, first answer, second answer)

RUNS = {"fused": SIGNALS, **{name: (name,) for name in SIGNALS}}


def load_queries(path: Path) -> list[dict]:
    """Labelled queries: JSON lines with id, query and causes (best first), and
    optionally followup: what the reporter posted next (scored as a second turn)."""
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
            query = {"id": item["id"], "query": item["query"], "causes": list(item["causes"])}
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}:{number}: expected JSON with id, query and causes") from None
        followup = item.get("followup")
        if followup is not None and not (isinstance(followup, str) and followup.strip()):
            raise UserError(f"{path}:{number}: followup must be text")
        queries.append({**query, "followup": followup} if followup else query)
    if not queries:
        raise UserError(f"{path}: no queries")
    return queries


def load_query_sets(paths: list[Path]) -> list[dict]:
    """Several labelled files pooled into one list, each query tagged with its file's name.

    Pooled figures over all real-report sets are what a generality claim rests
    on; a query id may appear only once across them, or a report would count twice.
    """
    pooled: list[dict] = []
    seen: dict[str, Path] = {}
    names = set_names(paths)
    for path in paths:
        for item in load_queries(path):
            if item["id"] in seen:
                raise UserError(f"{path}: query id {item['id']!r} is also in {seen[item['id']]}")
            seen[item["id"]] = path
            pooled.append({**item, "set": names[path]})
    return pooled


def set_names(paths: list[Path]) -> dict[Path, str]:
    """Each file's name in the per-set table: its stem, or its path where stems repeat
    (a.jsonl in two folders must not merge into one row)."""
    stems = [path.stem for path in paths]
    return {path: path.stem if stems.count(path.stem) == 1 else str(path) for path in paths}


def by_set(queries: list[dict], rankings: list[list[str]]) -> dict[str, dict]:
    """Fused top-1 / recall@3 / MRR of each file in a pooled evaluation, in the given order."""
    groups: dict[str, tuple[list[dict], list[list[str]]]] = {}
    for item, ranked in zip(queries, rankings):
        items, ranks = groups.setdefault(item.get("set", ""), ([], []))
        items.append(item)
        ranks.append(ranked)
    return {
        name: {"queries": len(items), **mean_scores(items, ranks)}
        for name, (items, ranks) in groups.items()
    }


def format_by_set(rows: dict[str, dict]) -> str:
    lines = [f"{'set':34} {'queries':>7} {'top1':>6} {'recall@3':>9} {'MRR':>6}"]
    for name, row in rows.items():
        lines.append(
            f"{name:34} {row['queries']:7d} {row['top1']:6.3f} {row['recall3']:9.3f} {row['mrr']:6.3f}"
        )
    return "\n".join(lines)


def score_ranking(ranked: list[str], relevant: list[str]) -> dict[str, float]:
    """top1: the first result is relevant; recall3: a relevant one in the top 3; rr: 1/rank."""
    wanted = set(relevant)
    first = next((i for i, cid in enumerate(ranked, 1) if cid in wanted), None)
    return {
        "top1": float(first == 1),
        "recall3": float(first is not None and first <= 3),
        "mrr": 1.0 / first if first else 0.0,
    }


def mean_scores(queries: list[dict], rankings: list[list[str]]) -> dict[str, float]:
    """score_ranking's top1 / recall3 / mrr averaged over the queries, to 4 places."""
    totals = {"top1": 0.0, "recall3": 0.0, "mrr": 0.0}
    for item, ranked in zip(queries, rankings):
        for key, value in score_ranking(ranked, item["causes"]).items():
            totals[key] += value
    return {key: round(value / len(queries), 4) for key, value in totals.items()}


def all_signal_scores(engine, queries: list[dict]) -> list[dict]:
    """Every signal's cause scores per query (computed once, fused per run)."""
    scores: list[dict] = [{} for _ in queries]
    for rows in held_out_groups(engine, queries):
        for row in rows:
            scores[row] = engine.signal_scores(queries[row]["query"])
    return scores


def held_out_groups(engine, queries: list[dict]):
    """Each labelled file's rows, yielded while the reports signal holds that file out.

    The reports signal learns from the labelled sets themselves: scoring a set
    with a model that learned it would measure memory, not the tool.
    """
    groups: dict[str, list[int]] = {}
    for row, item in enumerate(queries):
        groups.setdefault(item.get("set", ""), []).append(row)
    for rows in groups.values():
        with engine.holding_out([queries[row]["query"] for row in rows]):
            yield rows


def fused_rankings(per_query: list[dict]) -> list[list[str]]:
    """Cause ids best first per query, fused exactly as `ask` fuses them."""
    return [[r.id for r in fuse(with_shortcut(dict(scores)))] for scores in per_query]


def evaluate(engine, queries: list[dict]) -> dict:
    """Metrics per run (fused and each signal), the misses of the fused run and
    the confidence report, each labelled file held out once (held_out_groups)."""
    answers = answer_queries(engine, queries)
    return report_of(queries, answers, fused_rankings(answers.scores))


def report_of(queries: list[dict], answers: Answers, fused: list[list[str]]) -> dict:
    """`evaluate`'s report from one pass of answers and the fused rankings of
    their signal scores (exactly what `ask` fuses)."""
    per_query = answers.scores
    report: dict = {"queries": len(queries)}
    for run, signals in RUNS.items():
        if run == "fused":
            rankings = fused
        else:
            rankings = [[r.id for r in fuse({s: p.get(s, {}) for s in signals})] for p in per_query]
        report[run] = mean_scores(queries, rankings)
    report["misses"] = [
        {"id": item["id"], "want": item["causes"], "got": ranked[:3]}
        for item, ranked in zip(queries, fused)
        if not score_ranking(ranked, item["causes"])["top1"]
    ]
    # What a person reads first: the fused order after the verdicts (an error
    # signature's confirmation, a finding in code pasted into the question).
    # Only the five causes `ask` shows are ranked, so its MRR counts a cause
    # past the fifth as missing, where fused still ranks it.
    report["answered"] = mean_scores(queries, answers.answered)
    report["by_lang"] = top1_by_lang(queries, fused)
    report["confidence"] = answers.confidence
    if answers.two_turns is not None:
        report["two_turns"] = answers.two_turns
    return report


def top1_by_lang(queries: list[dict], rankings: list[list[str]]) -> dict[str, dict]:
    """Fused top-1 per question language (Chinese must do as well as English)."""
    from assistant.i18n import detect_lang

    groups: dict[str, list[float]] = {}
    for item, ranked in zip(queries, rankings):
        lang = detect_lang(item["query"][:20_000])
        groups.setdefault(lang, []).append(score_ranking(ranked, item["causes"])["top1"])
    return {
        lang: {"queries": len(hits), "top1": round(sum(hits) / len(hits), 4)}
        for lang, hits in sorted(groups.items())
    }


@dataclass
class Answers:
    """One pass of `ask` over labelled queries, each file held out once."""

    scores: list[dict]  # every signal's cause scores, per query
    answered: list[list[str]]  # the causes as `ask --no-probe` orders them, per query
    confidence: dict[str, dict]  # per level: answers, share, first cause right
    two_turns: dict | None  # over the queries with a followup (None: there are none)


def answer_queries(engine, queries: list[dict]) -> Answers:
    """Each query's signal scores, the confidence report and the two-turn report,
    in one pass over the labelled files (each held out once: see held_out_groups).

    The confidence report counts, per level as `ask --no-probe` states it, how
    many answers and how many right: "high" must be right at least 9 times in
    10 on reports it has never seen. A query with a followup is then asked a
    second time the way the chat asks it (second_turn).
    """
    from assistant.pipeline import Pipeline, Question

    pipeline = Pipeline(engine=engine)
    scores: list[dict] = [{} for _ in queries]
    answered: list[list[str]] = [[] for _ in queries]
    levels: dict[str, list[float]] = {}
    turns: list[TurnPair] = []
    for rows in held_out_groups(engine, queries):
        for row in rows:
            item = queries[row]
            scores[row] = engine.signal_scores(item["query"])
            result = pipeline.ask(Question(item["query"], top=5))
            ranked = answered[row] = [cause.id for cause in result.causes]
            levels.setdefault(result.confidence or "none", []).append(
                score_ranking(ranked, item["causes"])["top1"]
            )
            if item.get("followup"):
                turns.append((item, result, second_turn(pipeline, item, result)))
    confidence = {
        level: {
            "answers": len(hits),
            "share": round(len(hits) / len(queries), 4),
            "top1": round(sum(hits) / len(hits), 4),
        }
        for level, hits in sorted(levels.items())
    }
    return Answers(scores, answered, confidence, two_turn_report(turns))


def second_turn(pipeline, item: dict, first: Result) -> Result:
    """The chat's answer when the reporter's next message is the followup.

    The first answer becomes a turn of a real Conversation, so the second
    question carries exactly what the chat gives it (the earlier question and
    causes when that answer asked what would decide, its root error).
    """
    from assistant.chat.conversation import Conversation, Turn
    from assistant.pipeline import Question

    conversation = Conversation(turns=[Turn(query=item["query"], result=first)])
    question = Question(item["followup"], top=5, **conversation.follow_up())
    return pipeline.ask(question)


def two_turn_report(turns: list[TurnPair]) -> dict | None:
    """Over the queries with a followup: first- and second-turn top-1 / recall@3 / MRR,
    how many first answers asked for more (not "high", with what would decide), and
    how many second answers are "high" and how often those are right."""
    if not turns:
        return None
    items = [item for item, _, _ in turns]
    firsts = [[cause.id for cause in first.causes] for _, first, _ in turns]
    seconds = [[cause.id for cause in second.causes] for _, _, second in turns]
    high = [
        score_ranking(ranked, item["causes"])["top1"]
        for (item, _, second), ranked in zip(turns, seconds)
        if second.confidence == "high"
    ]
    return {
        "queries": len(turns),
        "asked": sum(bool(first.decide) and first.confidence != "high" for _, first, _ in turns),
        "first": mean_scores(items, firsts),
        "second": mean_scores(items, seconds),
        "second_high": {
            "answers": len(high),
            "top1": round(sum(high) / len(high), 4) if high else None,
        },
    }


def format_report(report: dict) -> str:
    lines = [f"{report['queries']} queries", f"{'run':10} {'top1':>6} {'recall@3':>9} {'MRR':>6}"]
    for run in RUNS:
        m = report[run]
        lines.append(f"{run:10} {m['top1']:6.3f} {m['recall3']:9.3f} {m['mrr']:6.3f}")
    if "answered" in report:
        m = report["answered"]
        lines.append(
            f"{'answered':10} {m['top1']:6.3f} {m['recall3']:9.3f} {m['mrr']:6.3f}"
            "  (the five `ask --no-probe` shows: fused, then the verdicts)"
        )
    for lang, row in report.get("by_lang", {}).items():
        lines.append(f"fused top-1 in {lang}: {row['top1']:.3f} ({row['queries']} queries)")
    for level, row in report.get("confidence", {}).items():
        lines.append(
            f"confidence {level:6} {row['answers']:4d} answers ({row['share']:.0%}), "
            f"first cause right {row['top1']:.3f}"
        )
    turns = report.get("two_turns")
    if turns:
        first, second = turns["first"], turns["second"]
        lines.append(
            f"two turns ({turns['queries']} queries with a followup, {turns['asked']} asked for more): "
            f"top-1 {first['top1']:.3f} -> {second['top1']:.3f}, "
            f"recall@3 {first['recall3']:.3f} -> {second['recall3']:.3f}"
        )
        high = turns["second_high"]
        if high["answers"]:
            lines.append(
                f"  second answers 'high': {high['answers']}, first cause right {high['top1']:.3f}"
            )
    if report["misses"]:
        lines.append(f"fused misses ({len(report['misses'])}):")
        lines += [f"  {m['id']}: want {m['want']} got {m['got']}" for m in report["misses"]]
    return "\n".join(lines)


# -- review: per cause, and against another revision of the KB ---------------------------


def by_cause(queries: list[dict], rankings: list[list[str]]) -> list[dict]:
    """Per expected cause (a query's first label): how often it comes first, or in the
    top 3, and which causes are taken for it when it does not; worst first."""
    rows: dict[str, dict] = {}
    for item, ranked in zip(queries, rankings):
        want = item["causes"][0]
        row = rows.setdefault(
            want, {"id": want, "queries": 0, "top1": 0, "recall3": 0, "taken_for": {}}
        )
        scores = score_ranking(ranked, item["causes"])
        row["queries"] += 1
        row["top1"] += int(scores["top1"])
        row["recall3"] += int(scores["recall3"])
        if not scores["top1"] and ranked:
            row["taken_for"][ranked[0]] = row["taken_for"].get(ranked[0], 0) + 1
    for row in rows.values():
        row["top1"] = round(row["top1"] / row["queries"], 4)
        row["recall3"] = round(row["recall3"] / row["queries"], 4)
        row["taken_for"] = dict(sorted(row["taken_for"].items(), key=lambda kv: (-kv[1], kv[0])))
    return sorted(rows.values(), key=lambda r: (r["top1"], r["recall3"], r["id"]))


def format_by_cause(rows: list[dict]) -> str:
    lines = [f"{'cause':34} {'queries':>7} {'top1':>6} {'recall@3':>9}  taken for"]
    for row in rows:
        confused = ", ".join(f"{cid} x{n}" for cid, n in row["taken_for"].items()) or "-"
        lines.append(
            f"{row['id']:34} {row['queries']:7d} {row['top1']:6.3f} {row['recall3']:9.3f}  {confused}"
        )
    return "\n".join(lines)


def compare_rankings(queries: list[dict], before: list[list[str]], after: list[list[str]]) -> dict:
    """Query by query, top-1 before and after a KB change: fixed, broken, unchanged."""
    report: dict = {"queries": len(queries), "fixed": [], "broken": [], "unchanged": 0}
    for item, old, new in zip(queries, before, after):
        was = score_ranking(old, item["causes"])["top1"]
        now = score_ranking(new, item["causes"])["top1"]
        entry = {"id": item["id"], "want": item["causes"], "before": old[:3], "after": new[:3]}
        if now > was:
            report["fixed"].append(entry)
        elif now < was:
            report["broken"].append(entry)
        else:
            report["unchanged"] += 1
    report["before"] = mean_scores(queries, before)
    report["after"] = mean_scores(queries, after)
    return report


def format_comparison(report: dict) -> str:
    lines = [
        f"{report['revision']} (before) -> working tree (after), {report['queries']} queries",
        f"{'':10} {'top1':>6} {'recall@3':>9} {'MRR':>6}",
    ]
    for side in ("before", "after"):
        m = report[side]
        lines.append(f"{side:10} {m['top1']:6.3f} {m['recall3']:9.3f} {m['mrr']:6.3f}")
    for kind in ("fixed", "broken"):
        lines.append(f"{kind} ({len(report[kind])}):")
        lines += [
            f"  {e['id']}: want {e['want']} was {e['before'][:1]} now {e['after'][:1]}"
            for e in report[kind]
        ]
    lines.append(f"unchanged: {report['unchanged']}")
    return "\n".join(lines)
