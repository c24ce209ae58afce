"""The values that flow between stages, and the `--json` output contract.

Every stage (clean, retrieve, probe, verdict, answer) speaks in these small
dataclasses so that a stage can be replaced without reading the others.
Nothing here imports torch, faiss or Textual.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from assistant.i18n import pick

VerdictValue = Literal["confirmed", "ruled_out", "inconclusive", "not_applicable", "not_run"]
ProbeStatus = Literal["ok", "failed", "timeout", "not_applicable", "error", "interrupted"]
# Where a verdict comes from: a probe on this machine, the error text itself,
# or a static finding in the user's script. A user reads "confirmed here" as
# "tested here", so the words shown depend on it.
VerdictSource = Literal["probe", "error", "script"]
Confidence = Literal["high", "medium", "low"]
# What the machine showed about a community answer's advice, kept beside the
# answer's community stance (never written over it).
HereOutcome = Literal["", "confirmed_here", "refuted_here"]

# The order a person reads (README, the --json contract): confirmed, inconclusive, not run,
# not applicable, ruled out, each within a score margin (verdicts/apply.py).
VERDICT_RANK = {
    "confirmed": 0,
    "inconclusive": 1,
    "not_run": 2,
    "not_applicable": 3,
    "ruled_out": 4,
}
# --json echoes the question; a 36 MB log must not come back whole.
QUERY_ECHO_CHARS = 2000


@dataclass(frozen=True)
class RootError:
    """The exception that started a failure: the first failing rank's own error."""

    type: str
    message: str
    rank: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Finding:
    """One static finding in a training script (from `assistant lint`)."""

    cause_id: str
    line: int
    message: str
    path: str = ""
    # "script" for a static finding; "question" for one in code pasted into
    # the question (lint.pasted); "probe" for what was observed in the user's
    # own running job (`assistant run`: where each rank waits).
    source: str = "script"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ProbeRun:
    """The outcome of one probe: its status and every rank's facts."""

    name: str
    status: ProbeStatus
    seconds: float
    ranks: list[dict] = field(default_factory=list)
    detail: str = ""

    def to_json(self) -> dict:
        """The contract's `probes[*]` entry."""
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 2)}

    def typed_records(self) -> list:
        """Every rank's record as a probe_protocol.RankRecord, its facts typed for this probe.

        `run.typed_facts()[0].local_rank_device.uuid` reads what
        `run.ranks[0]["facts"]["local_rank_device"]["uuid"]` does, with
        defaults where an older record lacks a key; `ranks` stays as it is.
        """
        from assistant.probing.protocol import RankRecord  # the protocol file, loaded on first use

        return [RankRecord.from_dict(record) for record in self.ranks]

    def typed_facts(self) -> list:
        """Per rank, the typed facts (DevicesFacts, BackendFacts, ... of probe_protocol)."""
        return [record.facts for record in self.typed_records()]


@dataclass
class Verdict:
    """What the probes say about one cause on this machine."""

    verdict: VerdictValue
    evidence: list[str] = field(default_factory=list)
    # Advice tags (see kb threads, `advice:`) that this machine refutes, e.g.
    # "set-device-after-init" when that variant failed here.
    refutes: list[str] = field(default_factory=list)
    # None while not judged (not_run); see VerdictSource.
    source: VerdictSource | None = None
    # Confirmed by what `assistant run` saw in the user's running job (a
    # hang's stacks): about this failure, so it leads like an error source.
    from_job: bool = False


@dataclass
class AnswerRef:
    """A community answer shown under a cause."""

    text: str
    lang: str
    thread: str
    stance: str
    note: str = ""
    answer_id: str = ""
    advice: str = ""
    contradicts: list[str] = field(default_factory=list)
    # The question this answer was given to: a stance ("wrong") is about that
    # question, not necessarily about the user's.
    question: str = ""
    # What this machine's probes showed about the answer's advice.
    here: HereOutcome = ""

    @classmethod
    def from_kb(cls, answer: dict, thread_id: str, question: str = "") -> AnswerRef:
        """From a KB thread answer (as a dict), its thread's id and question."""
        return cls(
            text=answer["text"],
            lang=answer["lang"],
            thread=thread_id,
            stance=answer["stance"],
            note=answer.get("note", ""),
            answer_id=answer["id"],
            advice=answer.get("advice", ""),
            contradicts=list(answer.get("contradicts", [])),
            question=question,
        )

    def to_json(self) -> dict:
        """The contract's `answers[*]`; `here` only when the machine settled the advice."""
        payload = {"text": self.text, "lang": self.lang, "thread": self.thread}
        payload["stance"] = self.stance
        if self.here:
            payload["here"] = self.here
        return payload


@dataclass(frozen=True)
class CauseDoc:
    """A cause's whole document, as its KB file gives it (one shape from file to screen).

    `text(field, lang)` is the one place where a Chinese field stands in for
    the English one (title_zh, summary_zh, why_zh, fix_zh), falling back to
    English where a cause has no translation.
    """

    id: str
    title: str
    title_zh: str = ""
    summary: str = ""
    summary_zh: str = ""
    why: str = ""
    why_zh: str = ""
    fix: str = ""
    fix_zh: str = ""
    fix_code: str = ""
    risks: str = ""
    signatures: tuple[str, ...] = ()
    symptoms: tuple[str, ...] = ()
    probes: tuple[str, ...] = ()
    references: tuple[tuple[str, str], ...] = ()  # (title, url)

    @classmethod
    def from_kb(cls, entry: dict) -> CauseDoc:
        """From a KB cause entry as a dict (a model_dump or the index's JSON)."""
        return cls(
            id=entry["id"],
            title=entry["title"],
            title_zh=entry.get("title_zh", ""),
            summary=entry.get("summary", ""),
            summary_zh=entry.get("summary_zh", ""),
            why=entry.get("why", ""),
            why_zh=entry.get("why_zh", ""),
            fix=entry.get("fix", ""),
            fix_zh=entry.get("fix_zh", ""),
            fix_code=entry.get("fix_code", ""),
            risks=entry.get("risks", ""),
            signatures=tuple(entry.get("signatures", ())),
            symptoms=tuple(entry.get("symptoms", ())),
            probes=tuple(entry.get("probes", ())),
            references=tuple(
                (ref["title"], ref["url"]) if isinstance(ref, dict) else tuple(ref)
                for ref in entry.get("references", ())
            ),
        )

    def text(self, name: str, lang: str = "en") -> str:
        """A text field in `lang`: the `_zh` variant for Chinese when it exists."""
        return pick(getattr(self, name), getattr(self, f"{name}_zh", ""), lang)


# The names CauseResult.from_doc copies from a document.
DOC_FIELDS = frozenset(each.name for each in fields(CauseDoc))


def as_mutable(value):
    """A document's tuple as the list a CauseResult holds (its probes); other values as they are."""
    return list(value) if isinstance(value, tuple) else value


@dataclass
class CauseResult:
    """One candidate cause, as ranked for a query."""

    id: str
    title: str
    score: float
    title_zh: str = ""
    summary: str = ""
    summary_zh: str = ""
    fix: str = ""
    fix_zh: str = ""
    fix_code: str = ""
    probes: list[str] = field(default_factory=list)
    answers: list[AnswerRef] = field(default_factory=list)
    signals: dict[str, int] = field(default_factory=dict)  # signal name -> rank (1-based)
    root_hit: bool = False  # a KB signature matched the root error itself (retrieve.RankedCause)
    # signal name -> how far ahead of the next cause, where this one is first (retrieve.RankedCause)
    leads: dict[str, float] = field(default_factory=dict)
    # A fresh Verdict each: a shared default would let one cause's evidence leak into all.
    verdict: Verdict = field(default_factory=lambda: Verdict("not_run"))

    @classmethod
    def from_kb(
        cls,
        entry: dict,
        score: float,
        answers: list[AnswerRef] | None = None,
        signals: dict[str, int] | None = None,
    ) -> CauseResult:
        """From a KB cause entry (as a dict), before any verdict."""
        return cls.from_doc(CauseDoc.from_kb(entry), score, answers, signals)

    @classmethod
    def from_doc(
        cls,
        doc: CauseDoc,
        score: float,
        answers: list[AnswerRef] | None = None,
        signals: dict[str, int] | None = None,
    ) -> CauseResult:
        """From a cause's document, before any verdict.

        Every field the two share is copied by name, so a KB field is mapped
        once (CauseDoc.from_kb): declaring it here as well carries it along.
        """
        shared = {
            each.name: as_mutable(getattr(doc, each.name))
            for each in fields(cls)
            if each.name in DOC_FIELDS
        }
        return cls(**shared, score=score, answers=list(answers or []), signals=dict(signals or {}))

    def text(self, name: str, lang: str = "en") -> str:
        """title / summary / fix in `lang`: the Chinese text where the KB has one."""
        return pick(getattr(self, name), getattr(self, f"{name}_zh", ""), lang)

    def to_json(self, lang: str = "en") -> dict:
        """The contract's `causes[*]` entry (keys and order fixed by the contract in README)."""
        fix = self.text("fix", lang)
        fix = fix if not self.fix_code else f"{fix}\n\n{self.fix_code}".strip()
        return {
            "id": self.id,
            "title": self.text("title", lang),
            "score": round(self.score, 4),
            "verdict": self.verdict.verdict,
            "verdict_source": self.verdict.source,
            "evidence": list(self.verdict.evidence),
            "answers": [a.to_json() for a in self.answers],
            "fix": fix,
        }


@dataclass
class Result:
    """A whole answer: what `assistant ask --json` prints."""

    query: str | None
    root_error: RootError | None
    causes: list[CauseResult]
    probes: list[ProbeRun] = field(default_factory=list)
    lang: str = "en"
    # How sure the first cause is (see assistant/confidence.py), and what
    # would decide between the leading causes when it is not "high".
    confidence: Confidence | None = None
    decide: list[str] = field(default_factory=list)
    # The handle `assistant feedback` takes ("this fixed it", "wrong cause").
    answer_id: str = ""
    # Multi-node doctor: per node, its facts and verdicts (None on one machine),
    # and why not every node could be checked ("" when they all were).
    nodes: list[dict] | None = None
    nodes_problem: str = ""

    def to_json(self) -> dict:
        """The --json contract (README); keys are only ever added."""
        payload = {
            "query": echo(self.query),
            "root_error": self.root_error.to_json() if self.root_error else None,
            "causes": [c.to_json(self.lang) for c in self.causes],
            "probes": [p.to_json() for p in self.probes],
            "confidence": self.confidence,
            "decide": list(self.decide),
            "answer_id": self.answer_id or None,
        }
        if self.query is not None and len(self.query) > QUERY_ECHO_CHARS:
            payload["query_chars"] = len(self.query)
        if self.nodes is not None:
            payload["nodes"] = self.nodes
        return payload


def echo(query: str | None) -> str | None:
    """The question as --json echoes it: whole when short, else its start and a note."""
    if query is None or len(query) <= QUERY_ECHO_CHARS:
        return query
    cut = len(query) - QUERY_ECHO_CHARS
    return f"{query[:QUERY_ECHO_CHARS]}\n[... {cut} more characters not echoed]"
