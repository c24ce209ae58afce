"""Human output for the terminal (rich): root error, ranked causes, answers, fix.

Written in the language of the question. Textual-free; the chat app has its
own widgets and reuses only the strings in assistant.i18n.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from assistant.i18n import t
from assistant.results import CauseResult, Result

VERDICT_STYLE = {
    "confirmed": "bold green",
    "ruled_out": "red",
    "inconclusive": "yellow",
    "not_applicable": "dim",
    "not_run": "dim",
}
STANCE_STYLE = {
    "right": "green",
    "confirmed_here": "bold green",
    "partly_right": "yellow",
    "unverified": "cyan",
    "wrong": "red",
    "refuted_here": "bold red",
}
ANSWER_PREVIEW = 280


def render_result(result: Result, console: Console, detail: int = 3) -> None:
    """Print a whole answer; the first `detail` causes get answers and fix."""
    lang = result.lang
    console.print(_root_error(result, lang))
    if not result.causes:
        console.print(Text(t("no_causes", lang), style="yellow"))
        return
    console.print(_cause_table(result, lang))
    for position, cause in enumerate(result.causes[:detail], start=1):
        console.print(_cause_panel(position, cause, lang))
    if result.probes:
        console.print(_probe_table(result, lang))


def _root_error(result: Result, lang: str) -> Text:
    error = result.root_error
    if error is None:
        return Text(t("no_root_error", lang), style="dim")
    rank = f" (rank {error.rank})" if error.rank is not None else ""
    text = Text(f"{t('root_error', lang)}{rank}: ", style="bold")
    text.append(f"{error.type}: ", style="bold red")
    text.append(error.message[:400])
    return text


def _title(cause: CauseResult, lang: str) -> str:
    return cause.title_zh if lang == "zh" and cause.title_zh else cause.title


def _cause_table(result: Result, lang: str) -> Table:
    table = Table(title=t("causes", lang), title_justify="left", expand=False)
    table.add_column("#", justify="right")
    table.add_column("id")
    table.add_column(t("causes", lang))
    table.add_column(t("score", lang), justify="right")
    table.add_column("verdict")
    for position, cause in enumerate(result.causes, start=1):
        verdict = cause.verdict.verdict
        table.add_row(
            str(position),
            cause.id,
            _title(cause, lang),
            f"{cause.score:.2f}",
            Text(t(f"verdict.{verdict}", lang), style=VERDICT_STYLE[verdict]),
        )
    return table


def _cause_panel(position: int, cause: CauseResult, lang: str) -> Panel:
    parts: list = []
    summary = cause.summary_zh if lang == "zh" and cause.summary_zh else cause.summary
    parts.append(Text(summary))
    if cause.verdict.evidence:
        parts.append(Text(f"\n{t('evidence', lang)}:", style="bold"))
        for line in cause.verdict.evidence:
            parts.append(Text(f"  • {line}", style=VERDICT_STYLE[cause.verdict.verdict]))
    if cause.answers:
        parts.append(Text(f"\n{t('answers', lang)}:", style="bold"))
        parts.extend(_answer_lines(cause))
    parts.append(Text(f"\n{t('fix', lang)}:", style="bold"))
    parts.append(Text(cause.fix.strip()))
    if cause.fix_code:
        parts.append(Syntax(cause.fix_code.rstrip(), "python", theme="ansi_dark", word_wrap=True))
    header = f"{position}. {_title(cause, lang)}  [{cause.id}]"
    return Panel(Group(*parts), title=header, title_align="left", border_style="blue")


def _answer_lines(cause: CauseResult) -> list[Text]:
    lines = []
    for answer in cause.answers:
        preview = " ".join(answer.text.split())
        if len(preview) > ANSWER_PREVIEW:
            preview = preview[:ANSWER_PREVIEW] + "…"
        line = Text("  ")
        line.append(
            f"[{t('stance.' + answer.stance, answer.lang)}] ",
            style=STANCE_STYLE.get(answer.stance, ""),
        )
        line.append(preview)
        line.append(f"  ({answer.thread}#{answer.answer_id})", style="dim")
        if answer.contradicts:
            line.append(
                f"  ↔ {t('contradicts', answer.lang)} {', '.join(answer.contradicts)}",
                style="magenta",
            )
        lines.append(line)
        if answer.note:
            lines.append(Text(f"      {answer.note}", style="italic dim"))
    return lines


def _probe_table(result: Result, lang: str) -> Table:
    table = Table(title=t("probes", lang), title_justify="left")
    table.add_column("probe")
    table.add_column("status")
    table.add_column("s", justify="right")
    table.add_column("detail")
    for run in result.probes:
        style = {"ok": "green", "timeout": "yellow", "not_applicable": "dim"}.get(run.status, "red")
        table.add_row(
            run.name, Text(run.status, style=style), f"{run.seconds:.1f}", run.detail[:80]
        )
    return table
