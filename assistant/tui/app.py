"""The Textual chat: paste a failing job's log, see causes, watch probes decide.

    run_chat()                                  # what `assistant` / `assistant chat` runs
    app = make_app(chat_deps(engine=FakeEngine(), runner=FakeRunner()))
    async with app.run_test() as pilot: ...

The chat runs the flow only through assistant.pipeline (one thread worker
per question, posting the pipeline's progress back as messages); its I/O
goes through the objects of assistant.tui.deps. The real engine and runner
are imported lazily, so the window opens before torch is loaded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import BindingType
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static

from assistant.chat.conversation import Conversation, Turn
from assistant.pipeline import Observer, Question
from assistant.tui import services
from assistant.tui.deps import ChatDeps, chat_deps
from assistant.tui.history_actions import HistoryActions
from assistant.tui.keys import LocalizedBindings, bilingual
from assistant.tui.messages import (
    Answered,
    CauseChosen,
    CauseEntryLoaded,
    CausesRanked,
    CopyFix,
    EngineLog,
    ModelFailed,
    ModelLoaded,
    Notice,
    ProbeProgress,
    ProbesFailed,
    QuerySubmitted,
    TurnFailed,
    TypedElsewhere,
)
from assistant.tui.present import fix_text, interface_lang, one_line
from assistant.tui.run_actions import RunActions
from assistant.tui.screens import (
    CauseScreen,
)
from assistant.tui.strings import command_title, tr
from assistant.tui.tools import ToolActions
from assistant.tui.turn import TurnView
from assistant.tui.widgets import ChatInput, StatusBar

QUIT_WAIT_SECONDS = 10.0  # the runner kills its process groups well within this
TICK_SECONDS = 0.5
# Palette commands: (string key, action name).
COMMANDS = (
    ("cmd.run", "run_command"),
    ("cmd.doctor", "doctor"),
    ("cmd.lint", "lint"),
    ("cmd.rebuild", "rebuild"),
    ("cmd.language", "switch_language"),
    ("cmd.export", "export"),
    ("cmd.history", "history"),
    ("cmd.clear_history", "clear_history"),
    ("cmd.new", "new_conversation"),
)


class ChatApp(LocalizedBindings, ToolActions, RunActions, HistoryActions, App[None]):
    """The chat. Build it with `make_app`.

    The palette's tools (tools.ToolActions), the watched launch and feedback
    (run_actions.RunActions) and the history (history_actions.HistoryActions)
    are mixins, each in its own module.
    """

    CSS_PATH = "app.tcss"
    TITLE = "DDP assistant"
    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("ctrl+l", "switch_language", "key.language", "app.language"),
        *bilingual("ctrl+r", "history", "key.history", "app.history"),
        *bilingual("ctrl+s", "export", "key.export", "app.export"),
        *bilingual("ctrl+n", "new_conversation", "key.new", "app.new", show=False),
        *bilingual("ctrl+q", "quit", "key.quit", "app.quit", priority=True),
    ]

    lang: reactive[str] = reactive("en")

    def __init__(self, deps: ChatDeps):
        super().__init__()
        self.deps = deps
        self.conversation = Conversation(created=deps.now())
        self.model_phase = "loading"
        self.model_error = ""
        self.last_copied: str | None = None
        self.last_export: Path | None = None
        self.history_error = ""
        self.notices: list[str] = []  # every notification shown, oldest first
        self.pending: list[TurnView] = []  # sent before the model was ready
        self.views: dict[int, TurnView] = {}  # turn key -> view
        self.next_key = 0
        self.runs = services.ProbeRuns()
        self.question_cancel: threading.Event | None = None  # the question being answered
        self.probe_lock = threading.Lock()  # one torchrun launch set at a time
        self.set_reactive(ChatApp.lang, deps.lang if deps.lang in ("en", "zh") else "en")

    # -- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusBar(self.deps.clock, id="status")
        with VerticalScroll(id="conversation"):
            yield Static(id="welcome")
        yield ChatInput(id="chat-input", cursor_blink=self.deps.cursor_blink)
        yield Static(id="input-hint")
        yield Footer()

    def on_mount(self) -> None:
        self.apply_lang()
        self.chat_input.focus()
        # Start slow work once the first frame is out: importing torch in a
        # thread competes for the interpreter lock and would delay the window.
        self.call_after_refresh(self.start_background_work)
        self.set_interval(TICK_SECONDS, self.tick)

    def start_background_work(self) -> None:
        self.load_model()
        if self.deps.history is not None:
            self.check_history()

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def turn_views(self) -> list[TurnView]:
        return list(self.views.values())

    def tick(self) -> None:
        # Elapsed times move on their own: the model load and running probes.
        if self.model_phase == "loading":
            self.status.refresh_view()
        for view in self.views.values():
            if view.running:
                view.refresh_view()

    def tell(self, message: str, severity: str = "information", timeout: float | None = None):
        """Show a notification (and keep it in `notices`)."""
        self.notices.append(message)
        self.notify(message, severity=severity, timeout=timeout)

    def on_notice(self, message: Notice) -> None:
        self.tell(message.text, message.severity)

    def action_focus_causes(self) -> None:
        """From the input, Tab goes to the newest list of causes (else on as usual)."""
        for view in reversed(self.turn_views):
            if view.causes.display:
                view.causes.focus()
                view.scroll_visible(animate=False)
                return
        self.screen.focus_next()

    def action_focus_input(self) -> None:
        self.chat_input.focus()

    def on_typed_elsewhere(self, message: TypedElsewhere) -> None:
        self.chat_input.type_in(message.text)

    def hint(self, text: str, error: bool = False) -> None:
        """The line under the input: why a send did nothing, or what happens next."""
        widget = self.query_one("#input-hint", Static)
        widget.update(text)
        widget.set_class(error, "-error")

    # -- language -----------------------------------------------------------------------

    def watch_lang(self, lang: str) -> None:
        if self.is_mounted:
            self.apply_lang()

    def apply_lang(self) -> None:
        """The interface speaks `lang`; turns keep their own language."""
        self.status.lang = self.lang
        self.chat_input.lang = self.lang
        self.query_one("#welcome", Static).update(tr("welcome", self.lang))
        self.refresh_bindings()

    def action_switch_language(self) -> None:
        self.lang = "zh" if self.lang == "en" else "en"

    # -- model --------------------------------------------------------------------------

    @work(exclusive=True, group="model", exit_on_error=False)
    async def load_model(self) -> None:
        """Load the engine (index + embedding model) without blocking the window."""
        try:
            await self.deps.knowledge.load()
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(ModelFailed(one_line(exc)))
        else:
            self.post_message(ModelLoaded())

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self.model_phase = "ready"
        self.status.set_state(phase="ready", note="", error="")
        pending, self.pending = self.pending, []
        for view in pending:
            self.start_question(view)
        if pending:
            self.hint("")

    def on_model_failed(self, message: ModelFailed) -> None:
        self.model_phase, self.model_error = "failed", message.error
        self.status.set_state(phase="failed", error=message.error)
        pending, self.pending = self.pending, []
        for view in pending:
            self.fail(view, tr("model.failed", self.lang, error=message.error))

    def on_engine_log(self, message: EngineLog) -> None:
        self.status.set_state(note=message.text)

    @property
    def engine_busy(self) -> bool:
        """An engine call (model load, index build, query) is running."""
        return self.deps.knowledge.busy

    # -- asking ---------------------------------------------------------------------------

    async def on_query_submitted(self, message: QuerySubmitted) -> None:
        text = message.text
        if not text.strip():
            self.hint(tr("input.empty", self.lang), error=True)
            return
        self.lang = interface_lang(text[:20_000], self.lang)
        self.chat_input.reset()
        view = await self.add_turn(Turn(query=text, lang=self.lang, created=self.deps.now()))
        if self.model_phase == "loading":
            self.pending.append(view)
            view.set_phase("waiting_model")
            self.hint(tr("input.queued", self.lang))
            return
        self.hint("")
        self.start_question(view)

    async def add_turn(self, turn: Turn) -> TurnView:
        self.conversation.add(turn)
        view = self.new_view(turn)
        self.query_one("#welcome").display = False
        conversation = self.query_one("#conversation", VerticalScroll)
        await conversation.mount(view)
        conversation.scroll_end(animate=False)
        return view

    def new_view(self, turn: Turn) -> TurnView:
        view = TurnView(self.next_key, turn, self.deps.clock)
        self.views[self.next_key] = view
        self.next_key += 1
        return view

    def index_of(self, view: TurnView) -> int:
        # By identity: two turns with the same question compare equal.
        return next(i for i, turn in enumerate(self.conversation.turns) if turn is view.turn)

    def start_question(self, view: TurnView) -> None:
        """Ask the pipeline; a question still running is stopped first."""
        before = self.index_of(view)
        known = self.conversation.probe_runs()
        question = Question(
            view.turn.query,
            top=self.deps.top,
            findings=self.conversation.findings(),
            script_checked=self.conversation.script_checked(),
            **self.conversation.follow_up(before),
            known_runs=list(known.values()),
            after=self.conversation.last_answer_id(before=before),
        )
        if self.question_cancel is not None:
            self.question_cancel.set()
        self.question_cancel = threading.Event()
        view.findings = list(question.findings)
        view.show_reused(known)
        view.set_phase("searching")
        self.ask_pipeline(view.key, question, self.question_cancel)

    def observer(self, key: int) -> Observer:
        """Pipeline callbacks (called on its threads) that post messages for turn `key`."""

        def causes(result) -> None:
            self.post_message(CausesRanked(key, result))

        def probe(event) -> None:
            self.post_message(
                ProbeProgress(key, event.probe, event.state, event.elapsed, event.status)
            )

        return Observer(on_causes=causes, on_probe=probe)

    @work(thread=True, exclusive=True, group="ask", exit_on_error=False)
    def ask_pipeline(self, key: int, question: Question, cancel: threading.Event) -> None:
        """One question through the whole flow (assistant.pipeline.Pipeline.ask)."""
        try:
            with self.runs.track(cancel), self.probe_lock:
                result = self.deps.pipeline.ask(question, self.observer(key), cancel)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(ProbesFailed(key, one_line(exc)))
        else:
            self.post_message(Answered(key, result))

    async def on_causes_ranked(self, message: CausesRanked) -> None:
        if self.model_phase == "failed":
            # A question retried the load (Engine.ask loads) and it worked this time.
            self.model_phase = "ready"
            self.status.set_state(phase="ready", error="")
        view = self.views.get(message.turn)
        if view is None:
            return  # the conversation was replaced meanwhile
        await view.show_result(message.result)
        view.set_phase("probing")
        self.bring_into_view(view)
        self.save()

    def on_probe_progress(self, message: ProbeProgress) -> None:
        view = self.views.get(message.turn)
        if view is not None:
            view.probe_event(message.probe, message.state, message.elapsed, message.status)

    async def on_answered(self, message: Answered) -> None:
        view = self.views.get(message.turn)
        if view is None:
            return
        for run in message.result.probes:
            view.probe_finished(run)
        view.finish_rows("interrupted")
        await view.show_result(message.result)
        view.set_phase("done")
        self.bring_into_view(view)
        self.save()

    def on_probes_failed(self, message: ProbesFailed) -> None:
        view = self.views.get(message.turn)
        if view is None:
            return
        if view.turn.result is None:  # nothing was shown: the question itself failed
            self.fail(view, message.error)
            return
        view.finish_rows("error")
        view.set_phase("done", error=tr("turn.probes_failed", view.lang, error=message.error))
        self.save()

    def on_turn_failed(self, message: TurnFailed) -> None:
        view = self.views.get(message.turn)
        if view is not None:
            self.fail(view, message.error)

    def fail(self, view: TurnView, error: str) -> None:
        view.turn.error = error
        view.set_phase("failed", error)
        self.save()

    def bring_into_view(self, view: TurnView) -> None:
        """Show the newest turn from its top once its answer arrives (older ones stay put)."""
        if self.turn_views and view is self.turn_views[-1]:
            self.call_after_refresh(view.scroll_visible, top=True, animate=False)

    # -- stopping ------------------------------------------------------------------------------

    def cancel_probes(self) -> None:
        """Ask every running flow to stop (the runner kills its process groups)."""
        self.runs.cancel_all()
        for view in self.views.values():
            if view.phase == "probing":
                view.finish_rows("interrupted")

    async def stop_probes(self, timeout: float = QUIT_WAIT_SECONDS) -> bool:
        """Cancel running probes and wait (off the UI thread) until they are gone."""
        self.cancel_probes()
        return await asyncio.to_thread(self.runs.wait_idle, timeout)

    def stop_probes_now(self, timeout: float = QUIT_WAIT_SECONDS) -> bool:
        """Cancel running probes and block until they are gone (for shutdown paths)."""
        self.runs.cancel_all()
        return self.runs.wait_idle(timeout)

    @property
    def probes_running(self) -> bool:
        return self.runs.count > 0

    async def action_quit(self) -> None:
        if self.probes_running:
            self.status.set_state(note=tr("busy.quit", self.lang))
        await self.stop_probes()
        self.exit()

    def on_unmount(self) -> None:
        # Exits that bypass action_quit (app.exit(), signals) still must not
        # leave a torchrun process group behind when the thread dies with us.
        self.stop_probes_now()
        self.deps.pipeline.close()

    # -- causes -------------------------------------------------------------------------------

    def on_cause_chosen(self, message: CauseChosen) -> None:
        view = self.views.get(message.turn)
        lang = view.lang if view is not None else self.lang
        findings = view.findings if view is not None else []
        self.push_screen(CauseScreen(message.cause, lang, findings))
        self.load_cause_entry(message.cause.id)

    @work(exclusive=True, group="detail", exit_on_error=False)
    async def load_cause_entry(self, cause_id: str) -> None:
        """Fetch the full KB entry for the detail screen."""
        try:
            entry = await self.deps.knowledge.entry(cause_id)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(CauseEntryLoaded(cause_id, None, one_line(exc)))
        else:
            self.post_message(CauseEntryLoaded(cause_id, entry))

    def on_cause_entry_loaded(self, message: CauseEntryLoaded) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, CauseScreen) and screen.cause.id == message.cause_id:
                screen.set_entry(message.entry, message.error)

    def on_copy_fix(self, message: CopyFix) -> None:
        text = fix_text(message.cause, message.entry)
        if not text:
            self.tell(tr("nothing_to_copy", self.lang), severity="warning")
            return
        self.copy_to_clipboard(text)
        self.last_copied = text
        self.tell(tr("copied", self.lang))

    # -- commands -----------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for key, action in COMMANDS:
            yield SystemCommand(
                command_title(key, self.lang),
                tr(f"{key}.help", self.lang),
                getattr(self, f"action_{action}"),
            )
        yield from super().get_system_commands(screen)

    async def action_new_conversation(self) -> None:
        await self.show_conversation(Conversation(created=self.deps.now()))
        self.tell(tr("new.done", self.lang))

    async def show_conversation(self, conversation: Conversation) -> None:
        """Replace the conversation on screen (running probes of the old one are stopped)."""
        self.cancel_probes()
        self.pending = []
        await self.query(TurnView).remove()
        self.views = {}
        self.conversation = conversation
        self.query_one("#welcome").display = not conversation.turns
        container = self.query_one("#conversation", VerticalScroll)
        findings = conversation.findings()
        for turn in conversation.turns:
            view = self.new_view(turn)
            await container.mount(view)
            await view.restore(findings)
        container.scroll_end(animate=False)
        self.chat_input.focus()


def make_app(deps: ChatDeps) -> ChatApp:
    """The chat over its dependencies (built by assistant.tui.deps.chat_deps)."""
    return ChatApp(deps)


def run_chat(model: str | None = None, lang: str | None = None, keep_history: bool = True) -> None:
    """Open the chat with the real engine, probe runner and (unless asked not to) history."""
    from assistant.chat.history import History, history_enabled
    from assistant.config import feedback_path, history_path
    from assistant.feedback import FeedbackStore

    app: ChatApp | None = None

    def engine_log(text: str) -> None:
        # The engine logs from the loading thread; a print would tear the screen.
        if app is not None:
            app.post_message(EngineLog(text))

    keep = keep_history and history_enabled()
    deps = chat_deps(
        engine=services.LazyEngine(model, log=engine_log),
        runner=services.LazyRunner(),
        history=History(history_path()) if keep else None,
        history_off=not keep,
        answers=FeedbackStore(feedback_path()) if keep else None,  # ids for feedback
        lang=lang,
    )
    app = make_app(deps)
    try:
        app.run()
    finally:
        app.stop_probes_now()
