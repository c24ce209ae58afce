"""A chat conversation: its turns, and the context a follow-up question carries.

The Textual chat keeps one `Conversation`; `assistant.chat.history` stores it and
`assistant.chat.export` turns it into Markdown. Nothing here imports Textual.

    conversation = Conversation()
    conversation.add(Turn(query=log_text, result=engine.ask(log_text)))
    engine.ask("what if I use gloo?", context=conversation.context())
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from assistant.i18n import short
from assistant.results import (
    AnswerRef,
    CauseResult,
    Finding,
    ProbeRun,
    Result,
    RootError,
    Verdict,
)

TurnKind = Literal["ask", "doctor", "lint"]

# A probe run that can stand for this machine for the rest of the
# conversation: it finished and produced facts. Failed, timed-out or
# interrupted runs are tried again by the next question.
REUSABLE_PROBE_STATUSES = ("ok", "not_applicable")

# Retrieval context stays short: it steers ranking, it is not a second query.
CONTEXT_ERROR_CHARS = 300
# A reply to "to tell these apart, paste: ..." carries the question it answers.
CONTEXT_QUESTION_CHARS = 600
TITLE_CHARS = 80
# What a run turn keeps of its job for the history: the chat shows 12 output
# lines and a line per rank; a job of 1,000 ranks or 10 kB lines must not
# make the history file grow with it.
JOB_OUTPUT_LINES = 50
JOB_RANK_LINES = 100
JOB_LINE_CHARS = 500


@dataclass
class JobRecord:
    """What a run turn showed of its watched launch, kept so a reloaded turn shows it again."""

    output: list[str] = field(default_factory=list)  # the output's last lines
    ranks: list[str] = field(default_factory=list)  # one line per rank, the logs line last
    seconds: float | None = None  # how long the job ran
    note: str = ""  # how it ended when there is no answer (exit 0, stopped)
    succeeded: bool = False

    @classmethod
    def kept(
        cls,
        output: list[str],
        ranks: list[str],
        seconds: float | None = None,
        note: str = "",
        succeeded: bool = False,
    ) -> JobRecord:
        """The record, bounded (JOB_OUTPUT_LINES, JOB_RANK_LINES, JOB_LINE_CHARS)."""
        tail = [cut_line(line) for line in output[-JOB_OUTPUT_LINES:]]
        return cls(tail, bounded_lines(ranks, JOB_RANK_LINES), seconds, cut_line(note), succeeded)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        """Rebuild a record written by `to_dict`, bounded again (the file may be edited)."""
        seconds = data.get("seconds")
        return cls.kept(
            [str(line) for line in data.get("output") or []],
            [str(line) for line in data.get("ranks") or []],
            float(seconds) if seconds is not None else None,
            str(data.get("note") or ""),
            bool(data.get("succeeded")),
        )


@dataclass
class Turn:
    """One question (or doctor run, or script lint) and what came back."""

    query: str
    lang: str = "en"
    kind: TurnKind = "ask"
    result: Result | None = None
    error: str = ""  # one line when the turn failed (retrieval error, bad path...)
    findings: list[Finding] = field(default_factory=list)  # of a "lint" turn
    created: float = 0.0  # seconds since the epoch
    job: JobRecord | None = None  # of a run turn: what its watched launch showed

    @property
    def root_error(self) -> RootError | None:
        """The root exception found in the query, if any."""
        return self.result.root_error if self.result else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that `Turn.from_dict` reads back."""
        return {
            "query": self.query,
            "lang": self.lang,
            "kind": self.kind,
            "result": result_to_dict(self.result) if self.result else None,
            "error": self.error,
            "findings": [f.to_json() for f in self.findings],
            "created": self.created,
            "job": self.job.to_dict() if self.job else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Turn:
        """Rebuild a turn saved with `to_dict`."""
        result, job = data.get("result"), data.get("job")
        return cls(
            query=data.get("query", ""),
            lang=data.get("lang", "en"),
            kind=data.get("kind", "ask"),
            result=result_from_dict(result) if result else None,
            error=data.get("error", ""),
            findings=[_build(Finding, f) for f in data.get("findings") or []],
            created=float(data.get("created") or 0.0),
            job=JobRecord.from_dict(job) if job else None,
        )


@dataclass
class Conversation:
    """The turns of one chat, oldest first; `id` is its row in the history."""

    turns: list[Turn] = field(default_factory=list)
    id: int | None = None
    created: float = 0.0

    def add(self, turn: Turn) -> int:
        """Append a turn and return its index."""
        self.turns.append(turn)
        return len(self.turns) - 1

    @property
    def title(self) -> str:
        """A one-line name: the first root error, else the first question's first line."""
        root = self.root_error()
        if root is not None:
            text = f"{root.type}: {root.message}"
        else:
            asks = [t for t in self.turns if t.kind == "ask"] or self.turns
            text = first_line(asks[0].query) if asks else ""
        return short(text, TITLE_CHARS)

    def root_error(self, before: int | None = None) -> RootError | None:
        """The first root error of the conversation (of turns before index `before`)."""
        for turn in self.turns[:before]:
            if turn.root_error is not None:
                return turn.root_error
        return None

    def confirmed(self, before: int | None = None) -> list[CauseResult]:
        """Causes confirmed on this machine so far, each once, latest verdict wins."""
        latest: dict[str, CauseResult] = {}
        for turn in self.turns[:before]:
            for cause in turn.result.causes if turn.result else []:
                latest[cause.id] = cause
        return [c for c in latest.values() if c.verdict.verdict == "confirmed"]

    def context(self, before: int | None = None) -> str | None:
        """What a follow-up question carries into retrieval: earlier root error and confirmed causes.

        None when nothing has been learned yet (a first question). When the
        answer before asked the person for more (its `decide`), their reply is
        read together with that earlier question.
        """
        parts = []
        asked = self.asked_to_decide(before)
        if asked is not None:
            parts.append(f"Earlier question: {short(asked.query, CONTEXT_QUESTION_CHARS)}")
        root = self.root_error(before)
        if root is not None:
            where = f" (rank {root.rank})" if root.rank is not None else ""
            parts.append(
                f"Earlier root error: {root.type}: "
                f"{short(root.message, CONTEXT_ERROR_CHARS)}{where}."
            )
        confirmed = self.confirmed(before)
        if confirmed:
            names = "; ".join(f"{c.title} ({c.id})" for c in confirmed)
            parts.append(f"Confirmed on this machine: {names}.")
        return " ".join(parts) or None

    def follow_up(self, before: int | None = None) -> dict[str, Any]:
        """What the next question carries from this conversation, as Question's
        fields: the context retrieval reads, and the answer its ranking adds to
        (`earlier` after "what would decide", `previous` after a sure answer).
        The chat, `ask --after` and `kb eval`'s second turn all ask so."""
        return {
            "context": self.context(before),
            "earlier": self.earlier_answer(before),
            "previous": self.previous_answer(before),
        }

    def earlier_answer(self, before: int | None = None) -> list[CauseResult]:
        """The causes of the answer that asked for what would decide ([] if none did):
        a reply adds to that report, its ranking merged with them
        (pipeline.with_earlier_answer)."""
        asked = self.asked_to_decide(before)
        return list(asked.result.causes) if asked is not None else []

    def previous_answer(self, before: int | None = None) -> list[CauseResult]:
        """The causes of the latest answer before `before` when it asked nothing
        (it was sure, so it had no "what would decide"); [] otherwise. A reply
        with no error of its own adds to that report (Question.previous)."""
        latest = self.latest_answered(before)
        if latest is None or asks_to_decide(latest):
            return []
        return list(latest.result.causes)

    def last_answer_id(self, before: int | None = None) -> str | None:
        """The kept id of the latest answer before `before`: a follow-up replies to
        it, so `assistant ask --after` on the follow-up's id reads the whole chat."""
        latest = self.latest_answered(before)
        if latest is None:
            return None
        return latest.result.answer_id or None

    def asked_to_decide(self, before: int | None = None) -> Turn | None:
        """The latest question before `before` if its answer asked what would decide."""
        latest = self.latest_answered(before)
        return latest if latest is not None and asks_to_decide(latest) else None

    def latest_answered(self, before: int | None = None) -> Turn | None:
        """The latest question before `before` that has an answer."""
        for turn in reversed(self.turns[:before]):
            if turn.kind == "ask" and turn.result is not None:
                return turn
        return None

    def findings(self) -> list[Finding]:
        """Script-lint findings, from the latest lint of each script."""
        by_path: dict[str, list[Finding]] = {}
        for turn in self.turns:
            if turn.kind == "lint" and not turn.error:
                by_path[turn.query] = list(turn.findings)
        return [f for findings in by_path.values() for f in findings]

    def script_checked(self) -> bool:
        """A script was linted in this conversation (its findings, maybe none, are known)."""
        return any(turn.kind == "lint" and not turn.error for turn in self.turns)

    def probe_runs(self) -> dict[str, ProbeRun]:
        """The latest reusable run of each probe (see REUSABLE_PROBE_STATUSES)."""
        runs: dict[str, ProbeRun] = {}
        for turn in self.turns:
            for run in turn.result.probes if turn.result else []:
                if run.status in REUSABLE_PROBE_STATUSES:
                    runs[run.name] = run
        return runs

    def latest_result(self) -> Result | None:
        """The result of the most recent turn that has one."""
        for turn in reversed(self.turns):
            if turn.result is not None:
                return turn.result
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "created": self.created,
            "turns": [t.to_dict() for t in self.turns],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        return cls(
            turns=[Turn.from_dict(t) for t in data.get("turns") or []],
            id=data.get("id"),
            created=float(data.get("created") or 0.0),
        )


# -- helpers ------------------------------------------------------------------


def first_line(text: str) -> str:
    """The first non-blank line of `text`, stripped ('' when there is none)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def cut_line(line: str, limit: int = JOB_LINE_CHARS) -> str:
    """`line` cut to `limit` characters with an ellipsis (its indentation kept)."""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def bounded_lines(lines: list[str], limit: int) -> list[str]:
    """At most `limit` lines, each cut: the first ones, a count of those left out, the last."""
    if len(lines) <= limit:
        return [cut_line(line) for line in lines]
    head = [cut_line(line) for line in lines[: limit - 2]]
    return [*head, f"… {len(lines) - limit + 1} more", cut_line(lines[-1])]


# -- full-fidelity (de)serialization of results --------------------------------
# Result.to_json() is the public --json contract and drops fields the chat
# needs again after a restart (answers' notes, probe facts, signals), so the
# history stores the whole dataclasses.


def result_to_dict(result: Result) -> dict[str, Any]:
    """Every field of a Result as plain JSON-ready data."""
    return dataclasses.asdict(result)


def result_from_dict(data: dict[str, Any]) -> Result:
    """Rebuild a Result written by `result_to_dict`; unknown keys are ignored."""
    root = data.get("root_error")
    return Result(
        query=data.get("query"),
        root_error=_build(RootError, root) if root else None,
        causes=[_cause_from_dict(c) for c in data.get("causes") or []],
        probes=[_build(ProbeRun, p) for p in data.get("probes") or []],
        lang=data.get("lang", "en"),
        confidence=data.get("confidence"),
        decide=list(data.get("decide") or []),
        answer_id=data.get("answer_id") or "",
    )


def _cause_from_dict(data: dict[str, Any]) -> CauseResult:
    fields = _known(CauseResult, data)
    fields["answers"] = [_build(AnswerRef, a) for a in data.get("answers") or []]
    fields["verdict"] = _build(Verdict, data.get("verdict") or {"verdict": "not_run"})
    return CauseResult(**fields)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The items of `data` that are fields of dataclass `cls` (newer files may carry more)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _build(cls: type, data: dict[str, Any]):
    return cls(**_known(cls, data))


def asks_to_decide(turn: Turn) -> bool:
    """The turn's answer was unsure and said what would decide."""
    return bool(turn.result.decide) and turn.result.confidence != "high"
