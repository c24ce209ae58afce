"""A conversation as Markdown, ready to paste into an issue tracker.

    text = conversation_markdown(conversation, lang="en")
    path = write_report(text, folder, now=time.time())   # OSError -> ExportFailed

A folder that cannot be written (read-only, gone) raises ExportFailed with a
one-line reason; the chat then offers another path, the home folder or the
clipboard.

The report holds what a maintainer needs to reproduce and judge the failure:
the root error, the environment facts the probes measured, the verdict on
each candidate cause with its evidence, the fix as a code block, script-lint
findings, and the questions asked. Nothing here imports Textual.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from assistant.chat.conversation import Conversation, first_line
from assistant.i18n import cause_title, short, t, verdict_label
from assistant.results import CauseResult, ProbeRun, Result

MAX_FACTS_PER_PROBE = 24
FACT_VALUE_CHARS = 160


class ExportFailed(Exception):
    """The report could not be written to `path`; `reason` is one line."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot write {path}: {reason}")
        self.path = path
        self.reason = reason


def report_name(now: float) -> str:
    """The report's file name, from the local time (one per second)."""
    return time.strftime("ddp-assistant-%Y%m%d-%H%M%S.md", time.localtime(now))


def write_report(text: str, target: Path, now: float) -> Path:
    """Write the report into folder `target` (or to file `target` when it ends in .md).

    Raises ExportFailed with the operating system's reason in one line.
    """
    target = Path(os.path.expanduser(str(target)))
    path = target if target.suffix.lower() == ".md" else target / report_name(now)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ExportFailed(path, exc.strerror or str(exc)) from None
    return path


def home_folder() -> Path:
    """Where a report goes when the chosen folder cannot take it."""
    return Path.home()


def _s(key: str, lang: str) -> str:
    return t(f"report.{key}", lang)


def conversation_markdown(conversation: Conversation, lang: str = "en") -> str:
    """The whole conversation as one Markdown document (ends with a newline)."""
    result = conversation.latest_result()
    sections = [
        f"# {_s('title', lang)}: {conversation.title or '-'}",
        _root_error_section(conversation, lang),
        _verdict_section(result, lang, conversation.findings()),
        _fix_section(result, lang),
        _environment_section(conversation, lang),
        _findings_section(conversation, lang),
        _launches_section(conversation, lang),
        _questions_section(conversation, lang),
    ]
    return "\n\n".join(s for s in sections if s).rstrip() + "\n"


def _root_error_section(conversation: Conversation, lang: str) -> str:
    root = conversation.root_error()
    if root is None:
        return f"## {t('root_error', lang)}\n\n{t('no_root_error', lang)}."
    where = f" ({_s('rank', lang)} {root.rank})" if root.rank is not None else ""
    return f"## {t('root_error', lang)}{where}\n\n" + fence(f"{root.type}: {root.message}", "text")


def _verdict_section(result: Result | None, lang: str, findings: list) -> str:
    head = f"## {_s('verdicts', lang)}"
    if result is None:
        return f"{head}\n\n{_s('no_result', lang)}"
    if not result.causes:
        return f"{head}\n\n{t('no_causes', lang)}."
    rows = [
        f"| # | {_s('cause', lang)} | {_s('verdict', lang)} | {t('score', lang)} |",
        "|---|---|---|---|",
    ]
    details = []
    for number, cause in enumerate(result.causes, 1):
        title = cause_title(cause, lang)
        verdict = verdict_label(cause, lang, findings)
        rows.append(
            f"| {number} | {_cell(title)} (`{cause.id}`) | {_cell(verdict)} | {cause.score:.2f} |"
        )
        if cause.verdict.evidence:
            evidence = "\n".join(f"- {line}" for line in cause.verdict.evidence)
            details.append(f"**{number}. {title}** ({verdict}):\n\n{evidence}")
    return "\n\n".join([head, "\n".join(rows), *details])


def fix_causes(result: Result | None) -> list[CauseResult]:
    """Whose fix the report shows: every confirmed cause, else the best-ranked one."""
    if result is None or not result.causes:
        return []
    confirmed = [c for c in result.causes if c.verdict.verdict == "confirmed"]
    return confirmed or [result.causes[0]]


def _fix_section(result: Result | None, lang: str) -> str:
    causes = fix_causes(result)
    if not causes:
        return ""
    parts = [f"## {t('fix', lang)}"]
    for cause in causes:
        parts.append(f"### {cause_title(cause, lang)} (`{cause.id}`)")
        if cause.fix.strip():
            parts.append(cause.fix.strip())
        if cause.fix_code.strip():
            parts.append(fence(cause.fix_code.rstrip(), "python"))
    return "\n\n".join(parts)


def _environment_section(conversation: Conversation, lang: str) -> str:
    runs = _latest_runs(conversation)
    head = f"## {_s('environment', lang)}"
    if not runs:
        return f"{head}\n\n{_s('no_probes', lang)}"
    lines = []
    for run in runs:
        detail = f": {short(run.detail, FACT_VALUE_CHARS)}" if run.detail else ""
        lines.append(f"- **{run.name}**: {run.status}, {run.seconds:.1f} s{detail}")
        lines.extend(f"  - {fact}" for fact in probe_facts(run))
    return f"{head}\n\n" + "\n".join(lines)


def _latest_runs(conversation: Conversation) -> list[ProbeRun]:
    """The latest run of each probe across the conversation, in first-run order."""
    runs: dict[str, ProbeRun] = {}
    for turn in conversation.turns:
        for run in turn.result.probes if turn.result else []:
            runs[run.name] = run
    return list(runs.values())


def probe_facts(run: ProbeRun, limit: int = MAX_FACTS_PER_PROBE) -> list[str]:
    """'key: value' lines from every rank's facts; values that differ show per rank."""
    flat = [_flatten(rank) for rank in run.ranks if isinstance(rank, dict)]
    keys: list[str] = []
    for facts in flat:
        keys.extend(k for k in facts if k not in keys and k != "rank")
    lines = []
    for key in keys[:limit]:
        values = [facts.get(key, "-") for facts in flat]
        if len(set(values)) == 1:
            lines.append(f"{key}: {values[0]}")
        else:
            ranks = [facts.get("rank", i) for i, facts in enumerate(flat)]
            per_rank = ", ".join(f"rank {r}={v}" for r, v in zip(ranks, values))
            lines.append(f"{key}: {per_rank}")
    if len(keys) > limit:
        lines.append(f"… (+{len(keys) - limit})")
    return lines


def _flatten(facts: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys, every value as a short string."""
    flat: dict[str, str] = {}
    for key, value in facts.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = short(", ".join(str(v) for v in value) or "[]", FACT_VALUE_CHARS)
        else:
            flat[name] = short(str(value), FACT_VALUE_CHARS)
    return flat


def _findings_section(conversation: Conversation, lang: str) -> str:
    findings = conversation.findings()
    if not findings:
        return ""
    lines = [f"- {f.path or '?'}:{f.line} `{f.cause_id}`: {f.message}" for f in findings]
    return f"## {_s('findings', lang)}\n\n" + "\n".join(lines)


def _launches_section(conversation: Conversation, lang: str) -> str:
    """Each launch watched by `run` from the chat: its command, every rank, the output's end.

    A maintainer reading the report needs which rank failed where, not only the
    verdicts the answer drew from it.
    """
    parts = []
    for turn in conversation.turns:
        if turn.job is None:
            continue
        ran = f" ({turn.job.seconds:.1f} s)" if turn.job.seconds is not None else ""
        parts.append(f"### {code_span(short(first_line(turn.query), 200))}{ran}")
        if turn.job.note:
            parts.append(turn.job.note)
        if turn.job.ranks:
            parts.append("\n".join(f"- {line}" for line in turn.job.ranks))
        if turn.job.output:
            parts.append(fence("\n".join(turn.job.output), "text"))
    if not parts:
        return ""
    return "\n\n".join([f"## {_s('launches', lang)}", *parts])


def _questions_section(conversation: Conversation, lang: str) -> str:
    asks = [turn for turn in conversation.turns if turn.kind == "ask"]
    if not asks:
        return ""
    lines = []
    for number, turn in enumerate(asks, 1):
        count = len(turn.query.splitlines())
        more = f" ({count} {_s('lines', lang)})" if count > 1 else ""
        lines.append(f"{number}. {_cell(short(first_line(turn.query), 120))}{more}")
    return f"## {_s('questions', lang)}\n\n" + "\n".join(lines)


def fence(text: str, info: str = "") -> str:
    """`text` in a fenced code block whose fence no line of `text` can close."""
    marks = "`" * max(3, _longest_backticks(text) + 1)
    return f"{marks}{info}\n{text}\n{marks}"


def code_span(text: str) -> str:
    """One line of `text` as inline code that none of its backticks can close.

    Inside a code span a backslash is literal, so nothing is escaped (a `|`
    of the command stays a `|`).
    """
    marks = "`" * (_longest_backticks(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{marks}{pad}{text}{pad}{marks}"


def _longest_backticks(text: str) -> int:
    return max((len(run) for run in _backtick_runs(text)), default=0)


def _backtick_runs(text: str) -> list[str]:
    runs, current = [], ""
    for char in text:
        if char == "`":
            current += char
        elif current:
            runs.append(current)
            current = ""
    if current:
        runs.append(current)
    return runs


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
