"""Every custom message of the chat: workers and widgets post them, the app handles them."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from assistant.results import CauseResult, Finding, Result


@dataclass
class QuerySubmitted(Message):
    """The person pressed the send key; `text` is the whole input, pastes expanded."""

    text: str


@dataclass
class Notice(Message):
    """A screen or widget has something to tell the person (the app shows it)."""

    text: str
    severity: str = "information"


@dataclass
class TypedElsewhere(Message):
    """Printable text was typed while a list had focus; it belongs in the input."""

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
class CausesRanked(Message):
    """The pipeline ranked the causes of turn `turn` (verdicts not run yet)."""

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
class Answered(Message):
    """The pipeline returned the judged answer of turn `turn` (question or doctor)."""

    turn: int
    result: Result


@dataclass
class ProbesFailed(Message):
    """The flow of turn `turn` raised after its causes were shown; `error` is one line."""

    turn: int
    error: str


@dataclass
class Rejudged(Message):
    """New findings re-judged the answer of turn `turn` (no probe was rerun)."""

    turn: int
    result: Result


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
class ClearHistory(Message):
    """The person asked to delete every saved conversation (confirmation comes next)."""


@dataclass
class ConversationDeleted(Message):
    """A saved conversation was deleted in the history screen."""

    conversation_id: int


@dataclass
class RunOutput(Message):
    """The watched job of turn `turn` wrote `data` on `stream` ("stdout" | "stderr")."""

    turn: int
    stream: str
    data: bytes


@dataclass
class RunEnded(Message):
    """The watched job of turn `turn` ended (`launch`: its LaunchReport); the diagnosis follows."""

    turn: int
    launch: object


@dataclass
class RunDiagnosed(Message):
    """The watched launch of turn `turn` and its answer (`outcome`: a RunOutcome)."""

    turn: int
    outcome: object


@dataclass
class CauseFeedback(Message):
    """The person said cause `cause` fixed it or is wrong (`verdict`: "fixed" | "wrong")."""

    cause: CauseResult
    verdict: str


@dataclass
class FeedbackGiven(Message):
    """Feedback on cause `cause_id` of the answer `answer_id` ("" when it was not kept)."""

    answer_id: str
    cause_id: str
    verdict: str
