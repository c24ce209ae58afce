"""Every custom message of the chat: workers and widgets post them, the app handles them."""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.message import Message

from assistant.results import CauseResult, Finding, ProbeRun, Result


@dataclass
class QuerySubmitted(Message):
    """The person pressed the send key; `text` is the whole input, pastes expanded."""

    text: str


@dataclass
class ModelLoaded(Message):
    """The engine finished loading (index checked, model in memory)."""


@dataclass
class ModelFailed(Message):
    """The engine could not load; `error` is one line."""

    error: str


@dataclass
class EngineLog(Message):
    """A progress line from the engine (e.g. 'rebuilding the index')."""

    text: str


@dataclass
class HistoryChecked(Message):
    """The history file was opened at start-up; `error` is one line when it cannot be used."""

    error: str = ""


@dataclass
class RetrievalDone(Message):
    """Retrieval answered turn `turn`."""

    turn: int
    result: Result


@dataclass
class TurnFailed(Message):
    """Turn `turn` could not be answered; `error` is one line."""

    turn: int
    error: str


@dataclass
class ProbeProgress(Message):
    """A probe of turn `turn` started or finished (from the runner's thread)."""

    turn: int
    probe: str
    state: str  # "started" | "finished"
    elapsed: float
    status: str | None = None


@dataclass
class ProbesDone(Message):
    """The probes of turn `turn` finished and verdicts were applied."""

    turn: int
    result: Result
    runs: list[ProbeRun] = field(default_factory=list)


@dataclass
class ProbesFailed(Message):
    """Running the probes of turn `turn` raised; `error` is one line."""

    turn: int
    error: str


@dataclass
class LintDone(Message):
    """A script lint for turn `turn` returned its findings."""

    turn: int
    findings: list[Finding]


@dataclass
class RebuildDone(Message):
    """The knowledge base rebuild finished; `summary` is one line, `error` set on failure."""

    summary: str = ""
    error: str = ""


@dataclass
class CauseChosen(Message):
    """The person opened cause `cause` of the turn with key `turn`."""

    turn: int
    cause: CauseResult


@dataclass
class CopyFix(Message):
    """The person asked to copy the fix of `cause` (`entry` is the full KB entry if known)."""

    cause: CauseResult
    entry: dict | None = None


@dataclass
class CauseEntryLoaded(Message):
    """The full KB entry of a cause arrived for the detail screen (`error` when it did not)."""

    cause_id: str
    entry: dict | None
    error: str = ""


@dataclass
class ConversationChosen(Message):
    """A saved conversation was picked in the history screen."""

    conversation_id: int


@dataclass
class ConversationDeleted(Message):
    """A saved conversation was deleted in the history screen."""

    conversation_id: int
