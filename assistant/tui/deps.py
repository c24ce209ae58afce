"""What the chat depends on, as typed protocols, and the one factory that builds it.

    deps = chat_deps(engine=LazyEngine(), runner=LazyRunner(), history=History(path))
    app = make_app(deps)

`run_chat` and the tests both come through `chat_deps`: the tests hand it a
fake engine and runner (and may choose the pipeline class), everything else
is the real code. The app reaches I/O only through these objects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from assistant.chat import export
from assistant.chat.conversation import Conversation
from assistant.pipeline import Observer, Pipeline, Question
from assistant.results import Finding, ProbeRun, Result
from assistant.tui import services

TOP_CAUSES = 5


class Asking(Protocol):
    """The one flow (assistant.pipeline.Pipeline)."""

    def ask(
        self,
        question: Question,
        observer: Observer | None = None,
        cancel: threading.Event | None = None,
    ) -> Result: ...

    def judge(
        self, result: Result, runs: Sequence[ProbeRun], findings: Sequence[Finding] = ()
    ) -> Result: ...

    def doctor(
        self,
        lang: str = "en",
        observer: Observer | None = None,
        cancel: threading.Event | None = None,
    ) -> Result: ...

    def close(self) -> None: ...


class KnowledgeBase(Protocol):
    """Loading and maintaining the knowledge side (assistant.tui.services.Knowledge)."""

    @property
    def ready(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    async def load(self) -> None: ...

    async def rebuild(self) -> str: ...

    async def entry(self, cause_id: str) -> dict: ...


class HistoryStore(Protocol):
    """Saved conversations (assistant.chat.history.History)."""

    path: Path

    def save(self, conversation: Conversation, now: float | None = None) -> int: ...

    def list(self, limit: int = 200) -> list: ...

    def load(self, conversation_id: int) -> Conversation: ...

    def delete(self, conversation_id: int) -> None: ...

    def clear(self) -> int: ...

    def notice_due(self) -> bool: ...

    def mark_notice_shown(self) -> None: ...


class Exporter(Protocol):
    """The Markdown report and where it is written (assistant.chat.export)."""

    def markdown(self, conversation: Conversation, lang: str) -> str: ...

    def write(self, text: str, target: Path, now: float) -> Path: ...

    def home(self) -> Path: ...


class Launching(Protocol):
    """Runs a launch command and answers for it (assistant.tui.services.Launcher)."""

    def run(self, command: list[str], callbacks: Any, cancel: threading.Event) -> Any:
        """A RunOutcome; `callbacks` is an assistant.watch.RunCallbacks."""
        ...


class AnswerStore(Protocol):
    """Answers kept for feedback (assistant.feedback.FeedbackStore)."""

    def remember(self, query: str, cause_ids: list[str], after: str | None = None) -> str: ...

    def record(self, handle: str, cause_id: str, verdict: str, note: str = "") -> None: ...


Linter = Callable[[str], list[Finding]]


@dataclass(frozen=True)
class MarkdownExporter:
    """The real exporter: assistant.chat.export's functions."""

    def markdown(self, conversation: Conversation, lang: str) -> str:
        return export.conversation_markdown(conversation, lang)

    def write(self, text: str, target: Path, now: float) -> Path:
        return export.write_report(text, target, now)

    def home(self) -> Path:
        return export.home_folder()


def local_time(stamp: float) -> str:
    """A timestamp as the person's local 'YYYY-MM-DD HH:MM'."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))


@dataclass
class ChatDeps:
    """Everything the chat uses from outside itself.

    clock: monotonic seconds (elapsed times); now: epoch seconds (turn and
    history stamps). Both are injectable so snapshots show no moving time.
    """

    pipeline: Asking
    knowledge: KnowledgeBase
    lint: Linter
    launcher: Launching
    answers: AnswerStore | None = None  # None: answers are not kept (no feedback)
    exporter: Exporter = field(default_factory=MarkdownExporter)
    history: HistoryStore | None = None
    history_off: bool = False  # the person asked to keep nothing (--no-history)
    export_dir: Path | None = None  # None: the current directory
    lang: str | None = None
    top: int = TOP_CAUSES
    clock: Callable[[], float] = time.monotonic
    now: Callable[[], float] = time.time
    format_time: Callable[[float], str] = local_time
    cursor_blink: bool = True


def chat_deps(
    *,
    engine: Any,
    runner: Any,
    history: HistoryStore | None = None,
    history_off: bool = False,
    lint: Linter | None = None,
    exporter: Exporter | None = None,
    answers: AnswerStore | None = None,
    launcher: Launching | None = None,
    run_probe: bool = True,
    pipeline_type: Callable[..., Asking] = Pipeline,
    **options: Any,
) -> ChatDeps:
    """The chat's dependencies around an engine and a probe runner.

    engine: .load(), .ready, .ask(query, top, context), .signatures(),
        .rebuild(), .cause(id) (assistant.knowledge.engine.Engine or a fake);
        every call is made on one engine thread (services.Knowledge).
    runner: .run(names, on_progress, cancel) (assistant.probing.runner.ProbeRunner).
    answers: keeps every answer under an answer_id for feedback (a
        FeedbackStore; None when history is off: no ids, no feedback).
    launcher: runs "Run a launch command" (default: services.Launcher over
        the same engine thread; run_probe=False skips its probes).
    pipeline_type: builds the flow from (engine=, runner=); tests may pass a
        Pipeline subclass.
    options: the remaining ChatDeps fields (lang, top, clock, now, ...).
    """
    knowledge = services.Knowledge(engine)
    keeping = {"answers": answers} if answers is not None else {}
    return ChatDeps(
        pipeline=pipeline_type(engine=knowledge, runner=runner, **keeping),
        knowledge=knowledge,
        lint=lint or services.lint_script,
        launcher=launcher or services.Launcher(knowledge, probe=run_probe),
        answers=answers,
        exporter=exporter or MarkdownExporter(),
        history=history,
        history_off=history_off,
        **options,
    )
