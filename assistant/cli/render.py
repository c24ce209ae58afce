"""Human output for the terminal (rich): root error, ranked causes, answers, fix.

Written in the language of the question. The default answer fits a screen or
two at 80 columns: the first cause in full, the others one line each; `full`
shows every cause in full. A verdict always says where it comes from (a
probe on this machine, the error text, the user's script), because a person
reads "confirmed here" as "tested here".

Textual-free; all words come through assistant.i18n.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from assistant.i18n import here_outcome, short, source_words, translate, verdict_label
from assistant.results import AnswerRef, CauseResult, ProbeRun, Result

VERDICT_STYLE = {
    "confirmed": "bold green",
    "ruled_out": "red",
    "inconclusive": "yellow",
    "not_applicable": "dim",
    "not_run": "dim",
}
STANCE_STYLE = {
    "right": "green",
    "partly_right": "yellow",
    "unverified": "cyan",
    "wrong": "red",
}
HERE_STYLE = {"confirmed_here": "bold green", "refuted_here": "bold red"}
CONFIDENCE_STYLE = {"high": "bold green", "medium": "yellow", "low": "red"}
ANSWER_PREVIEW = 240
QUESTION_PREVIEW = 70
SHORT_ANSWERS = 3  # answers under the first cause in the default view
ERROR_PREVIEW = 400

# The terminal's own words; the shared ones (fix, evidence, stance.*, ...) are
# i18n.STRINGS, which `word` falls back to.
CLI_WORDS: dict[str, dict[str, str]] = {
    "machine_check": {
        "en": "Machine check: every cause judged by probes on this machine (no question asked)",
        "zh": "本机检查：用本机探针逐一判断每个原因（未提供问题）",
    },
    "decide": {
        "en": "To tell the leading causes apart, add",
        "zh": "要区分这几个原因，请补充",
    },
    "full_hint": {
        "en": "--full shows every cause in full; `assistant explain ID` one cause's document",
        "zh": "--full 显示全部原因的详情；`assistant explain ID` 查看单个原因的文档",
    },
    "given_to": {"en": "said to", "zh": "针对的问题"},
    "reply_hint": {
        "en": 'add what it asks for: assistant ask --after {id} "<what you add>"',
        "zh": '补充所需信息：assistant ask --after {id} "<补充的内容>"',
    },
    "read_as_reply": {
        "en": "Read as a reply to answer {id}, with the {count} earlier question(s) of its thread",
        "zh": "作为对回答 {id} 的回复来读，连同它所在对话中之前的 {count} 个问题",
    },
    "script_clean": {
        "en": "{path}: assistant lint found none of its mistakes in this script",
        "zh": "{path}：assistant lint 没有在这个脚本里发现它能检查的错误",
    },
    "feedback_hint": {
        "en": "answer {id}: tell us what fixed it: assistant feedback {id} --cause ID --fixed",
        "zh": "回答 {id}：告诉我们是什么解决了问题：assistant feedback {id} --cause ID --fixed",
    },
    "verdict_col": {"en": "verdict", "zh": "结论"},
    "id_col": {"en": "id", "zh": "id"},  # ids are handles people type: the same in both
    # The probe table: its columns, and each probe status (results.ProbeStatus).
    "probe.name": {"en": "probe", "zh": "探针"},
    "probe.status": {"en": "status", "zh": "状态"},
    "probe.time": {"en": "time", "zh": "耗时"},
    "probe.detail": {"en": "detail", "zh": "详情"},
    "probe.ok": {"en": "ok", "zh": "完成"},
    "probe.failed": {"en": "failed", "zh": "失败"},
    "probe.timeout": {"en": "timeout", "zh": "超时"},
    "probe.not_applicable": {"en": "not applicable", "zh": "不适用"},
    "probe.error": {"en": "error", "zh": "出错"},
    "probe.interrupted": {"en": "interrupted", "zh": "已中断"},
    # The side-by-side table of `doctor --nnodes` (NODE_ROWS); names of programs,
    # libraries and variables read the same in both languages.
    "node.title": {"en": "nodes", "zh": "节点"},
    "node.column": {"en": "node {rank}", "zh": "节点 {rank}"},
    "node.host": {"en": "host", "zh": "主机"},
    "node.addresses": {"en": "addresses", "zh": "地址"},
    "node.resolves": {"en": "host name ->", "zh": "主机名解析为"},
    "node.torch": {"en": "torch", "zh": "torch"},
    "node.cuda": {"en": "CUDA", "zh": "CUDA"},
    "node.nccl": {"en": "NCCL", "zh": "NCCL"},
    "node.driver": {"en": "driver", "zh": "驱动"},
    "node.gpus": {"en": "GPUs", "zh": "GPU"},
    "node.ifname": {"en": "*_SOCKET_IFNAME", "zh": "*_SOCKET_IFNAME"},
    "node.layout": {"en": "nnodes x nproc", "zh": "节点数 x 每节点进程数"},
    "node.master": {"en": "master", "zh": "主节点"},
    "node.gloo": {"en": "gloo all_reduce", "zh": "gloo all_reduce"},
    "node.nccl_all_reduce": {"en": "NCCL all_reduce", "zh": "NCCL all_reduce"},
    "node.problems": {"en": "problems", "zh": "问题"},
    "node.could_not_join": {"en": "could not join", "zh": "无法加入"},
    "node.never_joined": {"en": "never joined", "zh": "未加入"},
}


def word(key: str, lang: str, **values: object) -> str:
    """A word of the terminal output in `lang`: this module's own, else a shared one."""
    return translate(CLI_WORDS, key, lang, **values)


def render_result(result: Result, console: Console, full: bool = False) -> None:
    """Print a whole answer: the first cause in full, the others one line each."""
    lang = result.lang
    console.print(_heading(result, lang))
    if not result.causes:
        console.print(Text(word("no_causes", lang), style="yellow"))
        return
    if result.confidence:
        console.print(_confidence(result, lang))
    console.print(_cause_table(result.causes, lang))
    shown = result.causes if full else result.causes[:1]
    for position, cause in enumerate(shown, start=1):
        console.print(
            _cause_panel(position, cause, lang, full, color=console.color_system is not None)
        )
    if not full and len(result.causes) > 1:
        console.print(Text(word("full_hint", lang), style="dim"))
    if result.probes:
        console.print(_probe_table(result.probes, lang))
    if result.answer_id:
        if result.decide:
            console.print(Text(word("reply_hint", lang, id=result.answer_id), style="dim"))
        console.print(Text(word("feedback_hint", lang, id=result.answer_id), style="dim"))


def render_machine_check(result: Result, console: Console) -> None:
    """`assistant doctor`: every judged cause with its evidence, no retrieval scores."""
    lang = result.lang
    console.print(Text(word("machine_check", lang), style="bold"))
    judged = [c for c in result.causes if c.verdict.verdict != "not_run"]
    table = Table(expand=False, show_edge=False)
    table.add_column(word("id_col", lang), no_wrap=True)
    table.add_column(word("verdict_col", lang), no_wrap=True)
    table.add_column(word("evidence", lang), overflow="fold")
    for cause in judged:
        table.add_row(
            cause.id,
            Text(verdict_label(cause, lang), style=VERDICT_STYLE[cause.verdict.verdict]),
            "; ".join(cause.verdict.evidence) or "-",
        )
    console.print(table)
    nodes = _nodes_table(result.nodes, lang)
    if nodes is not None:
        console.print(nodes)
    if result.probes:
        console.print(_probe_table(result.probes, lang))


# Rows of the side-by-side table of `doctor --nnodes`: (word key of its label, value of a
# nodes_report entry).
NODE_ROWS = (
    ("node.host", lambda n: n.get("hostname")),
    ("node.addresses", lambda n: ", ".join(n.get("addresses") or [])),
    ("node.resolves", lambda n: ", ".join(n.get("hostname_addresses") or [])),
    ("node.torch", lambda n: n["versions"].get("torch")),
    ("node.cuda", lambda n: n["versions"].get("torch_cuda")),
    ("node.nccl", lambda n: n["versions"].get("nccl")),
    ("node.driver", lambda n: n["versions"].get("driver")),
    ("node.gpus", lambda n: n.get("gpus")),
    ("node.ifname", lambda n: ", ".join(f"{k}={v}" for k, v in n["interfaces"].items())),
    ("node.layout", lambda n: f"{n['told'].get('nnodes')} x {n['told'].get('nproc_per_node')}"),
    ("node.master", lambda n: f"{n['told'].get('master_addr')}:{n['told'].get('master_port')}"),
    ("node.gloo", lambda n: _collective(n["collectives"].get("gloo"))),
    ("node.nccl_all_reduce", lambda n: _collective(n["collectives"].get("nccl"))),
)


def _nodes_table(report: list[dict] | None, lang: str) -> Table | None:
    """`doctor --nnodes`: every node's facts side by side, a column per node rank."""
    if not report:
        return None
    table = Table(
        title=word("node.title", lang), title_justify="left", expand=False, show_edge=False
    )
    table.add_column("", no_wrap=True)
    for entry in report:
        table.add_column(word("node.column", lang, rank=entry["node_rank"]), overflow="fold")
    for key, value in NODE_ROWS:
        table.add_row(word(key, lang), *(_node_cell(entry, value, lang) for entry in report))
    table.add_row(
        word("node.problems", lang),
        *(
            Text(
                ", ".join(v["id"] for v in e.get("verdicts", []) if v["verdict"] == "confirmed")
                or "-"
            )
            for e in report
        ),
    )
    return table


def _node_cell(entry: dict, value, lang: str) -> str:
    if not entry.get("joined"):
        return word("node.could_not_join" if entry.get("error") else "node.never_joined", lang)
    shown = value(entry)
    return "-" if shown in (None, "") else str(shown)


def _collective(outcome: dict | None) -> str:
    if not outcome:
        return "-"
    if outcome.get("result") == "ok":
        return f"ok, {outcome.get('gbps')} GB/s"
    return f"{outcome.get('result')}: {outcome.get('reason') or outcome.get('error') or '-'}"


def _heading(result: Result, lang: str) -> Text:
    error = result.root_error
    if error is None:
        return Text(word("no_root_error", lang), style="dim")
    rank = f" (rank {error.rank})" if error.rank is not None else ""
    text = Text(f"{word('root_error', lang)}{rank}: ", style="bold")
    text.append(f"{error.type}: ", style="bold red")
    text.append(error.message[:ERROR_PREVIEW])
    return text


def _confidence(result: Result, lang: str) -> Text:
    level = result.confidence or "low"
    text = Text(word(f"confidence.{level}", lang), style=CONFIDENCE_STYLE[level])
    if result.decide:
        text.append(f"\n{word('decide', lang)}:", style="bold")
        for item in result.decide:
            text.append(f"\n  • {item}")
    return text


def _cause_table(causes: list[CauseResult], lang: str) -> Table:
    table = Table(title=word("causes", lang), title_justify="left", expand=False, show_edge=False)
    # Ids are handles people type and scores are read whole: on a narrow terminal
    # the verdict wraps instead (with no_wrap everywhere, rich cut the ids and
    # dropped the position column at 80 columns).
    widest = max((len(cause.id) for cause in causes), default=2)
    table.add_column("#", justify="right", no_wrap=True, min_width=len(str(len(causes))))
    table.add_column(word("id_col", lang), no_wrap=True, min_width=widest)
    table.add_column(word("verdict_col", lang))
    table.add_column(word("score", lang), justify="right", no_wrap=True, min_width=5)
    for position, cause in enumerate(causes, start=1):
        table.add_row(
            str(position),
            cause.id,
            Text(verdict_label(cause, lang), style=VERDICT_STYLE[cause.verdict.verdict]),
            f"{cause.score:.2f}",
        )
    return table


def _cause_panel(
    position: int, cause: CauseResult, lang: str, full: bool, color: bool = True
) -> Panel:
    """One cause in full; its fix code highlighted only where colours show (lexing the
    code costs ~80 ms of a cold start, for nothing when the output is piped)."""
    parts: list = [Text(f"{position}. {cause.text('title', lang)}", style="bold")]
    parts.append(Text(cause.text("summary", lang)))
    if cause.verdict.evidence:
        header = source_words(cause.verdict.source, lang) or word("evidence", lang)
        parts.append(Text(f"\n{header[:1].upper()}{header[1:]}:", style="bold"))
        for line in cause.verdict.evidence:
            parts.append(Text(f"  • {line}", style=VERDICT_STYLE[cause.verdict.verdict]))
    answers = cause.answers if full else cause.answers[:SHORT_ANSWERS]
    if answers:
        parts.append(Text(f"\n{word('answers', lang)}:", style="bold"))
        for answer in answers:
            parts.extend(answer_lines(answer, lang))
    parts.append(Text(f"\n{word('fix', lang)}:", style="bold"))
    parts.append(Text(cause.text("fix", lang).strip()))
    if cause.fix_code and color:
        from rich.syntax import Syntax  # pulls in pygments: only where it is used

        parts.append(Syntax(cause.fix_code.rstrip(), "python", theme="ansi_dark", word_wrap=True))
    elif cause.fix_code:
        parts.append(Text(cause.fix_code.rstrip()))
    return Panel(Group(*parts), title=cause.id, title_align="left", border_style="blue")


def answer_lines(answer: AnswerRef, lang: str) -> list[Text]:
    """A community answer: its stance, what this machine showed, the question it answered."""
    preview = short(answer.text, ANSWER_PREVIEW)
    line = Text("  ")
    line.append(f"[{word('stance.' + answer.stance, lang)}]", style=STANCE_STYLE.get(answer.stance))
    here = here_outcome(answer)
    if here:
        line.append(f" · {word('here.' + here, lang)}", style=HERE_STYLE[here])
    line.append(f" {preview}")
    line.append(f"  ({answer.thread}#{answer.answer_id})", style="dim")
    lines = [line]
    if answer.question and answer.stance != "right":
        asked = short(answer.question, QUESTION_PREVIEW)
        lines.append(Text(f"      {word('given_to', lang)}: {asked}", style="dim"))
    if answer.note:
        lines.append(Text(f"      {answer.note}", style="italic dim"))
    if answer.contradicts:
        lines.append(
            Text(f"      ↔ {word('contradicts', lang)} {', '.join(answer.contradicts)}", "magenta")
        )
    return lines


def probe_seconds(seconds: float) -> str:
    """Probe time as a person reads it: a few ms is not "0.0 s" (which reads as not run)."""
    return f"{seconds * 1000:.0f} ms" if seconds < 0.1 else f"{seconds:.1f} s"


def _probe_table(probes: list[ProbeRun], lang: str) -> Table:
    table = Table(title=word("probes", lang), title_justify="left", show_edge=False)
    table.add_column(word("probe.name", lang), no_wrap=True)
    table.add_column(word("probe.status", lang), no_wrap=True)
    table.add_column(word("probe.time", lang), justify="right", no_wrap=True)
    table.add_column(word("probe.detail", lang), overflow="fold")
    for run in probes:
        style = {"ok": "green", "timeout": "yellow", "not_applicable": "dim"}.get(run.status, "red")
        status = Text(word(f"probe.{run.status}", lang), style=style)
        table.add_row(run.name, status, probe_seconds(run.seconds), run.detail[:80])
    return table
