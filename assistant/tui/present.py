"""Pure presentation rules of the chat: no Textual, so they are unit-tested directly."""

from __future__ import annotations

import re

from assistant.chat.conversation import first_line
from assistant.i18n import community_stance, detect_lang, here_outcome, short
from assistant.results import AnswerRef, CauseResult

VERDICT_MARKS = {
    "confirmed": "✔",
    "ruled_out": "✘",
    "inconclusive": "?",
    "not_applicable": "–",
    "not_run": "·",
}
PROBE_MARKS = {
    "ok": "✔",
    "not_applicable": "–",
    "failed": "✘",
    "timeout": "⧗",
    "error": "✘",
    "interrupted": "■",
}

AGREEING_STANCES = ("right",)
CONTRADICTED_STANCES = ("wrong",)

_ERROR_WORDS = re.compile(r"error|exception|traceback|failed|\bat\s+/|\.py\"?, line", re.IGNORECASE)


def one_line(exc: BaseException) -> str:
    """An exception as one line for the interface (a UserError is already worded for people)."""
    from assistant.errors import UserError

    text = " ".join(str(exc).split())
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}".rstrip(": ")


def interface_lang(text: str, current: str) -> str:
    """The interface language after the person sends `text`.

    Chinese writing is always a choice, so it switches to Chinese. English
    switches back only when it is prose: an English error line or log pasted
    by a Chinese speaker must not flip the interface.
    """
    if detect_lang(text[:20_000]) == "zh":
        return "zh"
    lines = [line for line in text.splitlines() if line.strip()]
    looks_like_log = len(lines) > 3 or bool(_ERROR_WORDS.search(text[:20_000]))
    return current if looks_like_log else "en"


def query_preview(text: str, width: int = 200) -> tuple[str, int]:
    """(first non-blank line cut to `width`, how many more non-blank lines follow)."""
    head = short(first_line(text), width)
    count = 0
    for line in text.splitlines():
        if line.strip():
            count += 1
    return head, max(count - 1, 0)


def middle_cut(text: str, limit: int) -> str:
    """`text` on one line, its middle cut out when longer than `limit`.

    Error messages put the telling part last ("... Last error: Duplicate GPU
    detected"), so the tail is kept longer than the head.
    """
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    head = limit * 2 // 5
    tail = limit - head - 3
    return f"{flat[:head].rstrip()} … {flat[-tail:].lstrip()}"


def line_count(text: str) -> int:
    """Real lines in `text`: \n, \r\n and a terminal's bare \r all end one."""
    return len(text.splitlines())


def seconds(value: float) -> str:
    """A duration as the chat shows it: '6ms', '0.4s', '12.3s', '2m05s'.

    Milliseconds below a tenth of a second: the CPU probes of one launch take a
    few each, and "0.0s" read as if they had not run.
    """
    if value < 0.1:
        return f"{value * 1000:.0f}ms"
    if value < 60:
        return f"{value:.1f}s"
    minutes, rest = divmod(round(value), 60)
    return f"{minutes}m{rest:02d}s"


def human_size(chars: int) -> str:
    """A size in characters as 'KB' / 'MB' (characters stand for bytes here)."""
    if chars >= 1_000_000:
        return f"{chars / 1_000_000:.1f} MB"
    return f"{max(chars, 1) / 1000:.0f} KB"


def split_answers(answers: list[AnswerRef]) -> tuple[list[AnswerRef], list[AnswerRef]]:
    """(agreeing, contradicting) community answers, for the side-by-side view.

    The anchor is what is known to be right (the KB says so, or this machine
    confirmed it). An answer contradicts when it is known wrong, when this
    machine refuted it, or when it and an anchor contradict each other.
    Without an anchor, only known-wrong answers go to the right-hand side.
    """

    def key(answer: AnswerRef) -> tuple[str, str]:
        return (answer.thread, answer.answer_id)

    def agrees(answer: AnswerRef) -> bool:
        outcome = here_outcome(answer)
        if outcome:
            return outcome == "confirmed_here"
        return community_stance(answer) in AGREEING_STANCES

    def contradicted(answer: AnswerRef) -> bool:
        outcome = here_outcome(answer)
        if outcome:
            return outcome == "refuted_here"
        return community_stance(answer) in CONTRADICTED_STANCES

    anchors = [a for a in answers if agrees(a)]
    anchor_keys = {key(a) for a in anchors}
    against_anchor = {(a.thread, other) for a in anchors for other in a.contradicts}
    agreeing, contradicting = [], []
    for answer in answers:
        names_anchor = any((answer.thread, other) in anchor_keys for other in answer.contradicts)
        is_contradicting = contradicted(answer) or (
            key(answer) not in anchor_keys and (key(answer) in against_anchor or names_anchor)
        )
        (contradicting if is_contradicting else agreeing).append(answer)
    return agreeing, contradicting


def verdict_counts(causes: list[CauseResult]) -> dict[str, int]:
    """How many causes are confirmed, ruled out, and still open."""
    confirmed = sum(c.verdict.verdict == "confirmed" for c in causes)
    ruled_out = sum(c.verdict.verdict == "ruled_out" for c in causes)
    return {
        "confirmed": confirmed,
        "ruled_out": ruled_out,
        "other": len(causes) - confirmed - ruled_out,
    }


def fix_text(cause: CauseResult, entry: dict | None = None) -> str:
    """What 'copy the fix' copies: the fix code, else the fix prose."""
    code = (entry or {}).get("fix_code") or cause.fix_code
    return (code or (entry or {}).get("fix") or cause.fix or "").strip()


# -- a watched launch (the palette's "Run a launch command") -------------------------

OUTPUT_LINES = 12  # lines of the job's output a run turn keeps on screen
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")


class OutputTail:
    """The last `limit` lines of a job's output, fed as the bytes arrive.

    A job may print for hours: only the tail is kept, and a line split
    across two writes is joined before it counts.
    """

    def __init__(self, limit: int = OUTPUT_LINES):
        self.limit = limit
        self.lines: list[str] = []
        self.partial = ""
        self.total = 0  # complete lines seen, kept or not

    def feed(self, data: bytes) -> None:
        text = self.partial + _ANSI.sub("", data.decode("utf-8", "replace"))
        # A terminal's bare \r (progress bars) ends a line too.
        pieces = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self.partial = pieces.pop()
        self.total += len(pieces)
        self.lines = (self.lines + pieces)[-self.limit :]

    def shown(self) -> list[str]:
        """The kept lines, the unfinished last one included."""
        tail = self.lines + ([self.partial] if self.partial else [])
        return tail[-self.limit :]
