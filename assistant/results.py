"""The values that flow between stages, and the `--json` output contract.

Every stage (clean, retrieve, probe, verdict, answer) speaks in these small
dataclasses so that a stage can be replaced without reading the others.
Nothing here imports torch, faiss or Textual.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

VerdictValue = Literal["confirmed", "ruled_out", "inconclusive", "not_applicable", "not_run"]
ProbeStatus = Literal["ok", "failed", "timeout", "not_applicable", "error", "interrupted"]

# Sorting weight of a verdict when results are re-ranked after probes:
# confirmed causes rise, ruled-out ones sink, the rest keep retrieval order.
VERDICT_RANK = {
    "confirmed": 0,
    "inconclusive": 1,
    "not_run": 1,
    "not_applicable": 1,
    "ruled_out": 2,
}


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


@dataclass
class Verdict:
    """What the probes say about one cause on this machine."""

    verdict: VerdictValue
    evidence: list[str] = field(default_factory=list)
    # Advice tags (see kb threads, `advice:`) that this machine refutes, e.g.
    # "set-device-after-init" when that variant failed here.
    refutes: list[str] = field(default_factory=list)


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

    @classmethod
    def from_kb(cls, answer: dict, thread_id: str) -> AnswerRef:
        """From a KB thread answer (as a dict) and its thread's id."""
        return cls(
            text=answer["text"],
            lang=answer["lang"],
            thread=thread_id,
            stance=answer["stance"],
            note=answer.get("note", ""),
            answer_id=answer["id"],
            advice=answer.get("advice", ""),
            contradicts=list(answer.get("contradicts", [])),
        )

    def to_json(self) -> dict:
        return {"text": self.text, "lang": self.lang, "thread": self.thread, "stance": self.stance}


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
    fix_code: str = ""
    probes: list[str] = field(default_factory=list)
    answers: list[AnswerRef] = field(default_factory=list)
    signals: dict[str, int] = field(default_factory=dict)  # signal name -> rank (1-based)
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
        return cls(
            id=entry["id"],
            title=entry["title"],
            title_zh=entry["title_zh"],
            summary=entry["summary"],
            summary_zh=entry["summary_zh"],
            fix=entry["fix"],
            fix_code=entry["fix_code"],
            score=score,
            probes=list(entry["probes"]),
            answers=list(answers or []),
            signals=dict(signals or {}),
        )

    def to_json(self, lang: str = "en") -> dict:
        """The contract's `causes[*]` entry (keys and order fixed by DESIGN.md)."""
        fix = self.fix if not self.fix_code else f"{self.fix}\n\n{self.fix_code}".strip()
        return {
            "id": self.id,
            "title": self.title_zh if lang == "zh" and self.title_zh else self.title,
            "score": round(self.score, 4),
            "verdict": self.verdict.verdict,
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

    def to_json(self) -> dict:
        return {
            "query": self.query,
            "root_error": self.root_error.to_json() if self.root_error else None,
            "causes": [c.to_json(self.lang) for c in self.causes],
            "probes": [p.to_json() for p in self.probes],
        }
