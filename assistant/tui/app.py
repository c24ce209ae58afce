"""The Textual chat: paste a failing job's log, see causes, watch probes decide.

    run_chat()                        # what `assistant` / `assistant chat` runs
    app = make_app(engine=FakeEngine(), runner=FakeRunner(), history=History(tmp))
    async with app.run_test() as pilot: ...

`make_app` takes every dependency, so the tests drive the real app with fakes
and `run_chat` wires the real ones (imported lazily: the window opens before
torch is loaded). Slow work runs in thread workers that post the messages of
assistant.tui.messages back; the UI thread never waits on the engine or on a
probe.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static

from assistant.chat.conversation import Conversation, Turn
from assistant.errors import UserError
from assistant.chat.export import conversation_markdown
from assistant.results import ProbeRun, Result
from assistant.tui import services
from assistant.tui.messages import (
    CauseChosen,
    CauseEntryLoaded,
    ConversationChosen,
    ConversationDeleted,
    CopyFix,
    EngineLog,
    HistoryChecked,
    LintDone,
    ModelFailed,
    ModelLoaded,
    ProbeProgress,
    ProbesDone,
    ProbesFailed,
    QuerySubmitted,
    RebuildDone,
    RetrievalDone,
    TurnFailed,
)
from assistant.tui.present import fix_text, interface_lang
from assistant.tui.screens import CauseScreen, HistoryScreen, PathPrompt, local_time
from assistant.tui.strings import tr
from assistant.tui.widgets import ChatInput, StatusBar, TurnView, localize_bindings

TOP_CAUSES = 5
QUIT_WAIT_SECONDS = 10.0  # the runner kills its process groups well within this
TICK_SECONDS = 0.5


def one_line(exc: BaseException) -> str:
    """An exception as one line for the interface."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}".rstrip(": ")


class ProbeRuns:
    """The probe runs in flight, each with its cancel event.

    Worker threads enter `track()`; quitting calls `cancel_all()` and waits
    in `wait_idle()` until every run has returned (the runner kills its
    processes when its event is set).
    """

    def __init__(self) -> None:
        self._cancels: set[threading.Event] = set()
        self._changed = threading.Condition()

    @contextmanager
    def track(self) -> Iterator[threading.Event]:
        cancel = threading.Event()
        with self._changed:
            self._cancels.add(cancel)
        try:
            yield cancel
        finally:
            with self._changed:
                self._cancels.discard(cancel)
                self._changed.notify_all()

    @property
    def count(self) -> int:
        with self._changed:
            return len(self._cancels)

    def cancel_all(self) -> None:
        with self._changed:
            for cancel in self._cancels:
                cancel.set()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no run is in flight (True) or `timeout` passes (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._cancels, timeout)


class ChatApp(App[None]):
    """The chat. Build it with `make_app`."""

    CSS_PATH = "app.tcss"
    TITLE = "DDP assistant"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+l", "switch_language", "中文", id="app.language"),
        Binding("ctrl+r", "history", "History", id="app.history"),
        Binding("ctrl+s", "export", "Export", id="app.export"),
        Binding("ctrl+n", "new_conversation", "New", id="app.new", show=False),
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
    ]

    lang: reactive[str] = reactive("en")

    def __init__(
        self,
        *,
        engine: Any,
        runner: Any,
        linter: Callable[[str], list] | None,
        history: Any | None,
        lang: str | None,
        apply_verdicts: Callable,
        probes_for: Callable,
        doctor: Callable,
        clock: Callable[[], float],
        now: Callable[[], float],
        export_dir: Path | None,
        cursor_blink: bool,
        format_time: Callable[[float], str],
        top: int,
    ):
        super().__init__()
        self.engine = engine
        self.runner = runner
        self.linter = linter
        self.history = history
        self.apply_verdicts = apply_verdicts
        self.probes_for = probes_for
        self.doctor = doctor
        self.clock = clock
        self.now = now
        self.export_dir = export_dir
        self.cursor_blink = cursor_blink
        self.format_time = format_time
        self.top = top
        self.conversation = Conversation(created=now())
        self.model_phase = "loading"
        self.model_error = ""
        self.last_copied: str | None = None
        self.last_export: Path | None = None
        self.history_error = ""
        self._pending: list[TurnView] = []  # sent before the model was ready
        self._views: dict[int, TurnView] = {}  # turn key -> view
        self._next_key = 0
        self._runs = ProbeRuns()
        self.engine_thread = services.EngineThread()  # every engine call, one at a time
        self._probe_lock = threading.Lock()  # one torchrun launch set at a time
        self.set_reactive(ChatApp.lang, lang if lang in ("en", "zh") else "en")

    # -- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusBar(self.clock, id="status")
        with VerticalScroll(id="conversation"):
            yield Static(id="welcome")
        yield ChatInput(id="chat-input", cursor_blink=self.cursor_blink)
        yield Static(id="input-hint")
        yield Footer()

    def on_mount(self) -> None:
        self._apply_lang()
        self.query_one(ChatInput).focus()
        # Start slow work once the first frame is out: importing torch in a
        # thread competes for the interpreter lock and would delay the window.
        self.call_after_refresh(self._start_background_work)
        self.set_interval(TICK_SECONDS, self._tick)

    def _start_background_work(self) -> None:
        self.load_model()
        if self.history is not None:
            self.check_history()

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def turn_views(self) -> list[TurnView]:
        return list(self._views.values())

    def _tick(self) -> None:
        # Elapsed times move on their own: the model load and running probes.
        if self.model_phase == "loading":
            self.status.refresh_view()
        for view in self._views.values():
            if view.running:
                view.refresh_view()

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

    def hint(self, text: str, error: bool = False) -> None:
        """The line under the input: why a send did nothing, or what happens next."""
        widget = self.query_one("#input-hint", Static)
        widget.update(text)
        widget.set_class(error, "-error")

    # -- language -----------------------------------------------------------------------

    def watch_lang(self, lang: str) -> None:
        if self.is_mounted:
            self._apply_lang()

    def _apply_lang(self) -> None:
        lang = self.lang
        localize_bindings(self, lang)
        self.status.lang = lang
        self.chat_input.lang = lang
        self.query_one("#welcome", Static).update(tr("welcome", lang))
        for view in self._views.values():
            view.lang = lang
        for screen in self.screen_stack:
            if isinstance(screen, CauseScreen):
                screen.lang = lang
        self.refresh_bindings()

    def action_switch_language(self) -> None:
        self.lang = "zh" if self.lang == "en" else "en"

    # -- model --------------------------------------------------------------------------

    @work(exclusive=True, group="model", exit_on_error=False)
    async def load_model(self) -> None:
        """Load the engine (index + embedding model) without blocking the window."""
        try:
            await self.engine_thread.call(self.engine.load)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(ModelFailed(one_line(exc)))
        else:
            self.post_message(ModelLoaded())

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self.model_phase = "ready"
        self.status.set_state(phase="ready", note="")
        pending, self._pending = self._pending, []
        for view in pending:
            self._start_retrieval(view)
        if pending:
            self.hint("")

    def on_model_failed(self, message: ModelFailed) -> None:
        self.model_phase, self.model_error = "failed", message.error
        self.status.set_state(phase="failed", error=message.error)
        pending, self._pending = self._pending, []
        for view in pending:
            self._fail(view, tr("model.failed", self.lang, error=message.error))

    def on_engine_log(self, message: EngineLog) -> None:
        self.status.set_state(note=message.text)

    # -- asking ---------------------------------------------------------------------------

    async def on_query_submitted(self, message: QuerySubmitted) -> None:
        text = message.text
        if not text.strip():
            self.hint(tr("input.empty", self.lang), error=True)
            return
        self.lang = interface_lang(text[:20_000], self.lang)
        self.chat_input.reset()
        view = await self._add_turn(Turn(query=text, lang=self.lang, created=self.now()))
        if self.model_phase == "loading":
            self._pending.append(view)
            view.set_phase("waiting_model")
            self.hint(tr("input.queued", self.lang))
            return
        self.hint("")
        self._start_retrieval(view)

    async def _add_turn(self, turn: Turn) -> TurnView:
        self.conversation.add(turn)
        view = TurnView(self._next_key, turn, self.clock, self.lang)
        self._views[self._next_key] = view
        self._next_key += 1
        self.query_one("#welcome").display = False
        conversation = self.query_one("#conversation", VerticalScroll)
        await conversation.mount(view)
        conversation.scroll_end(animate=False)
        return view

    def _index_of(self, view: TurnView) -> int:
        # By identity: two turns with the same question compare equal.
        return next(i for i, turn in enumerate(self.conversation.turns) if turn is view.turn)

    def _start_retrieval(self, view: TurnView) -> None:
        context = self.conversation.context(before=self._index_of(view))
        view.set_phase("searching")
        self.retrieve(view.key, view.turn.query, context)

    @work(group="retrieve", exit_on_error=False)
    async def retrieve(self, key: int, query: str, context: str | None) -> None:
        """Rank the causes of one question (retrieval only)."""
        try:
            result = await self.engine_thread.call(
                self.engine.ask, query, top=self.top, context=context
            )
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(TurnFailed(key, one_line(exc)))
        else:
            self.post_message(RetrievalDone(key, result))

    async def on_retrieval_done(self, message: RetrievalDone) -> None:
        if self.model_phase == "failed":
            # A question retried the load (Engine.ask loads) and it worked this time.
            self.model_phase = "ready"
            self.status.set_state(phase="ready", error="")
        view = self._views.get(message.turn)
        if view is None:
            return  # the conversation was replaced meanwhile
        await view.show_result(message.result)
        self._bring_into_view(view)
        try:
            names = list(self.probes_for(message.result.causes))
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            view.set_phase("done", error=tr("turn.probes_failed", self.lang, error=one_line(exc)))
            self.save()
            return
        findings = self.conversation.findings()
        if not names and not findings:
            view.set_phase("done")
            self.save()
            return
        reused = {n: r for n, r in self.conversation.probe_runs().items() if n in names}
        view.expect_probes(names, reused)
        view.set_phase("probing")
        self.save()
        # The worker judges its own copy: the one on screen is read meanwhile.
        self.run_probes(view.key, copy.deepcopy(message.result), names, reused, findings)

    def _bring_into_view(self, view: TurnView) -> None:
        """Show the newest turn from its top once its answer arrives (older ones stay put)."""
        if self.turn_views and view is self.turn_views[-1]:
            self.call_after_refresh(view.scroll_visible, top=True, animate=False)

    def on_turn_failed(self, message: TurnFailed) -> None:
        view = self._views.get(message.turn)
        if view is not None:
            self._fail(view, message.error)

    def _fail(self, view: TurnView, error: str) -> None:
        view.turn.error = error
        view.set_phase("failed", error)
        self.save()

    # -- probes ------------------------------------------------------------------------------

    def _progress(self, key: int) -> Callable[[Any], None]:
        """A runner callback (called on the runner's thread) that posts ProbeProgress."""

        def report(event: Any) -> None:
            self.post_message(
                ProbeProgress(key, event.probe, event.state, event.elapsed, event.status)
            )

        return report

    @work(thread=True, group="probes", exit_on_error=False)
    def run_probes(
        self,
        key: int,
        result: Result,
        names: list[str],
        reused: dict[str, ProbeRun],
        findings: list,
    ) -> None:
        """Run the probes of one turn (skipping reused ones) and apply the verdicts."""
        try:
            with self._runs.track() as cancel, self._probe_lock:
                todo = [n for n in names if n not in reused]
                fresh = []
                if todo and not cancel.is_set():
                    fresh = self.runner.run(todo, on_progress=self._progress(key), cancel=cancel)
            by_name = {**reused, **{run.name: run for run in fresh}}
            runs = [by_name[n] for n in names if n in by_name]
            judged = self.apply_verdicts(result, runs, findings)
            if not judged.probes:
                judged.probes = list(runs)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(ProbesFailed(key, one_line(exc)))
        else:
            self.post_message(ProbesDone(key, judged, runs))

    def on_probe_progress(self, message: ProbeProgress) -> None:
        view = self._views.get(message.turn)
        if view is not None:
            view.probe_event(message.probe, message.state, message.elapsed, message.status)

    async def on_probes_done(self, message: ProbesDone) -> None:
        view = self._views.get(message.turn)
        if view is None:
            return
        for run in message.runs:
            if not view.probe_rows.get(run.name) or not view.probe_rows[run.name].reused:
                view.probe_finished(run)
        view.finish_rows("interrupted")
        await view.show_result(message.result)
        view.set_phase("done")
        self._bring_into_view(view)
        self.save()

    def on_probes_failed(self, message: ProbesFailed) -> None:
        view = self._views.get(message.turn)
        if view is None:
            return
        view.finish_rows("error")
        view.set_phase("done", error=tr("turn.probes_failed", self.lang, error=message.error))
        self.save()

    def cancel_probes(self) -> None:
        """Ask every running probe set to stop (the runner kills its process groups)."""
        self._runs.cancel_all()
        for view in self._views.values():
            if view.phase == "probing":
                view.finish_rows("interrupted")

    async def stop_probes(self, timeout: float = QUIT_WAIT_SECONDS) -> bool:
        """Cancel running probes and wait (off the UI thread) until they are gone."""
        self.cancel_probes()
        return await asyncio.to_thread(self._runs.wait_idle, timeout)

    def stop_probes_now(self, timeout: float = QUIT_WAIT_SECONDS) -> bool:
        """Cancel running probes and block until they are gone (for shutdown paths)."""
        self._runs.cancel_all()
        return self._runs.wait_idle(timeout)

    @property
    def probes_running(self) -> bool:
        return self._runs.count > 0

    @property
    def engine_busy(self) -> bool:
        """An engine call (model load, index build, query) is running."""
        return self.engine_thread.busy

    async def action_quit(self) -> None:
        if self.probes_running:
            self.status.set_state(note=tr("busy.quit", self.lang))
        await self.stop_probes()
        self.exit()

    def on_unmount(self) -> None:
        # Exits that bypass action_quit (app.exit(), signals) still must not
        # leave a torchrun process group behind when the thread dies with us.
        self.stop_probes_now()

    # -- causes -------------------------------------------------------------------------------

    def on_cause_chosen(self, message: CauseChosen) -> None:
        self.push_screen(CauseScreen(message.cause, self.lang))
        self.load_cause_entry(message.cause.id)

    @work(exclusive=True, group="detail", exit_on_error=False)
    async def load_cause_entry(self, cause_id: str) -> None:
        """Fetch the full KB entry for the detail screen."""
        try:
            entry = await self.engine_thread.call(self.engine.cause, cause_id)
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
            self.notify(tr("nothing_to_copy", self.lang), severity="warning")
            return
        self.copy_to_clipboard(text)
        self.last_copied = text
        self.notify(tr("copied", self.lang))

    # -- commands -----------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        lang = self.lang
        yield SystemCommand(tr("cmd.doctor", lang), tr("cmd.doctor.help", lang), self.action_doctor)
        yield SystemCommand(tr("cmd.lint", lang), tr("cmd.lint.help", lang), self.action_lint)
        yield SystemCommand(
            tr("cmd.rebuild", lang), tr("cmd.rebuild.help", lang), self.action_rebuild
        )
        yield SystemCommand(
            tr("cmd.language", lang), tr("cmd.language.help", lang), self.action_switch_language
        )
        yield SystemCommand(tr("cmd.export", lang), tr("cmd.export.help", lang), self.action_export)
        yield SystemCommand(
            tr("cmd.history", lang), tr("cmd.history.help", lang), self.action_history
        )
        yield SystemCommand(
            tr("cmd.new", lang), tr("cmd.new.help", lang), self.action_new_conversation
        )
        yield from super().get_system_commands(screen)

    # doctor

    async def action_doctor(self) -> None:
        view = await self._add_turn(
            Turn(query="doctor", lang=self.lang, kind="doctor", created=self.now())
        )
        view.set_phase("probing")
        self.run_doctor(view.key, self.lang)

    @work(thread=True, group="probes", exit_on_error=False)
    def run_doctor(self, key: int, lang: str) -> None:
        """Run every probe on this machine (assistant.diagnose.doctor)."""
        try:
            with self._runs.track() as cancel, self._probe_lock:
                result = self.doctor(
                    self.runner, lang=lang, on_progress=self._progress(key), cancel=cancel
                )
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(ProbesFailed(key, one_line(exc)))
        else:
            self.post_message(ProbesDone(key, result, list(result.probes)))

    # lint

    def action_lint(self) -> None:
        self.push_screen(PathPrompt(self.lang), callback=self._lint_path)

    async def _lint_path(self, path: str | None) -> None:
        if not path:
            return
        view = await self._add_turn(
            Turn(query=path, lang=self.lang, kind="lint", created=self.now())
        )
        view.set_phase("linting")
        self.lint(view.key, path)

    @work(thread=True, group="lint", exit_on_error=False)
    def lint(self, key: int, path: str) -> None:
        """Lint a training script (assistant.lint.script.lint_script)."""
        try:
            findings = list(self.linter(path))
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(TurnFailed(key, one_line(exc)))
        else:
            self.post_message(LintDone(key, findings))

    async def on_lint_done(self, message: LintDone) -> None:
        view = self._views.get(message.turn)
        if view is None:
            return
        view.turn.findings = list(message.findings)
        view.set_phase("done")
        await self._rejudge_latest()
        self.save()

    async def _rejudge_latest(self) -> None:
        """Findings changed: re-apply verdicts to the latest answered question."""
        for view in reversed(self.turn_views):
            if view.turn.kind == "ask" and view.phase == "done" and view.turn.result:
                result = view.turn.result
                try:
                    judged = self.apply_verdicts(
                        result, list(result.probes), self.conversation.findings()
                    )
                except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
                    view.set_phase("done", error=one_line(exc))
                    return
                if not judged.probes:
                    judged.probes = list(result.probes)
                await view.show_result(judged)
                return

    # rebuild

    def action_rebuild(self) -> None:
        self.status.set_state(note=tr("rebuild.started", self.lang))
        self.rebuild_kb()

    @work(group="rebuild", exit_on_error=False)
    async def rebuild_kb(self) -> None:
        """Recompile the knowledge base index and reload it."""
        try:
            summary = await self.engine_thread.call(self.engine.rebuild)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(RebuildDone(error=one_line(exc)))
        else:
            self.post_message(RebuildDone(summary=summary))

    def on_rebuild_done(self, message: RebuildDone) -> None:
        self.status.set_state(note="")
        if message.error:
            self.notify(tr("rebuild.failed", self.lang, error=message.error), severity="error")
            return
        self.notify(tr("rebuild.done", self.lang, summary=message.summary))
        if self.model_phase != "ready" and getattr(self.engine, "ready", False):
            self.post_message(ModelLoaded())

    # export

    def action_export(self) -> None:
        if not self.conversation.turns:
            self.notify(tr("export.empty", self.lang), severity="warning")
            return
        text = conversation_markdown(self.conversation, self.lang)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.now()))
        folder = self.export_dir or Path.cwd()
        path = folder / f"ddp-assistant-{stamp}.md"
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            self.notify(tr("export.failed", self.lang, error=exc), severity="error")
            return
        self.copy_to_clipboard(text)
        self.last_copied = text
        self.last_export = path
        self.notify(tr("export.done", self.lang, path=path))

    # history

    @work(thread=True, group="history", exit_on_error=False)
    def check_history(self) -> None:
        """Open the history file off the UI thread (this also pays sqlite-utils' import)."""
        try:
            self.history.list(limit=1)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(HistoryChecked(one_line(exc)))
        else:
            self.post_message(HistoryChecked())

    def on_history_checked(self, message: HistoryChecked) -> None:
        if message.error and not self.history_error:
            self.history_error = message.error
            self.notify(tr("history.unavailable", self.lang, error=message.error))

    def save(self) -> None:
        """Store the conversation in the history (quietly off when it cannot be opened)."""
        if self.history is None or self.history_error or not self.conversation.turns:
            return
        try:
            self.history.save(self.conversation, now=self.now())
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.history_error = one_line(exc)
            self.notify(tr("history.unavailable", self.lang, error=self.history_error))

    def _history_entries(self) -> list | None:
        if self.history is None:
            self.notify(tr("history.unavailable", self.lang, error="-"), severity="warning")
            return None
        try:
            return self.history.list()
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.notify(tr("history.unavailable", self.lang, error=one_line(exc)))
            return None

    def action_history(self) -> None:
        entries = self._history_entries()
        if entries is not None:
            self.push_screen(HistoryScreen(entries, self.lang, self.format_time))

    async def on_conversation_chosen(self, message: ConversationChosen) -> None:
        try:
            conversation = self.history.load(message.conversation_id)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.notify(one_line(exc), severity="error")
            return
        if isinstance(self.screen, HistoryScreen):
            self.pop_screen()
        await self.show_conversation(conversation)

    async def on_conversation_deleted(self, message: ConversationDeleted) -> None:
        try:
            self.history.delete(message.conversation_id)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.notify(one_line(exc), severity="error")
            return
        if self.conversation.id == message.conversation_id:
            self.conversation.id = None  # still on screen; saved again as new if it changes
        self.notify(tr("history.deleted", self.lang))
        entries = self._history_entries()
        if entries is not None and isinstance(self.screen, HistoryScreen):
            await self.screen.set_entries(entries)

    async def action_new_conversation(self) -> None:
        await self.show_conversation(Conversation(created=self.now()))
        self.notify(tr("new.done", self.lang))

    async def show_conversation(self, conversation: Conversation) -> None:
        """Replace the conversation on screen (running probes of the old one are stopped)."""
        self.cancel_probes()
        self._pending = []
        await self.query(TurnView).remove()
        self._views = {}
        self.conversation = conversation
        self.query_one("#welcome").display = not conversation.turns
        container = self.query_one("#conversation", VerticalScroll)
        for turn in conversation.turns:
            view = TurnView(self._next_key, turn, self.clock, self.lang)
            self._views[self._next_key] = view
            self._next_key += 1
            await container.mount(view)
            await view.restore()
        container.scroll_end(animate=False)
        self.chat_input.focus()


def make_app(
    *,
    engine: Any,
    runner: Any,
    linter: Callable[[str], list] | None = None,
    history: Any | None = None,
    lang: str | None = None,
    apply_verdicts: Callable | None = None,
    probes_for: Callable | None = None,
    doctor: Callable | None = None,
    clock: Callable[[], float] = time.monotonic,
    now: Callable[[], float] = time.time,
    export_dir: Path | None = None,
    cursor_blink: bool = True,
    format_time: Callable[[float], str] = local_time,
    top: int = TOP_CAUSES,
) -> ChatApp:
    """Build the chat from its dependencies (the CLI and the tests both come through here).

    engine:   .load(), .ready, .ask(query, top, context), .rebuild(), .cause(id)
    runner:   .run(names, on_progress, cancel) -> list[ProbeRun]
    linter:   lint_script(path) -> list[Finding]
    history:  assistant.chat.history.History, or None to keep nothing
    apply_verdicts / probes_for / doctor: default to assistant.verdicts and
    assistant.diagnose, imported when first used.
    clock (monotonic seconds) and now (epoch seconds) are injectable so
    snapshot tests show no moving time.
    """
    return ChatApp(
        engine=engine,
        runner=runner,
        linter=linter or services.lint_script,
        history=history,
        lang=lang,
        apply_verdicts=apply_verdicts or services.apply_verdicts,
        probes_for=probes_for or services.probes_for,
        doctor=doctor or services.doctor,
        clock=clock,
        now=now,
        export_dir=export_dir,
        cursor_blink=cursor_blink,
        format_time=format_time,
        top=top,
    )


def run_chat(model: str | None = None, lang: str | None = None) -> None:
    """Open the chat with the real engine, probe runner and history."""
    from assistant.config import history_path
    from assistant.chat.history import History

    app: ChatApp | None = None

    def engine_log(text: str) -> None:
        # The engine logs from the loading thread; a print would tear the screen.
        if app is not None:
            app.post_message(EngineLog(text))

    app = make_app(
        engine=services.LazyEngine(model, log=engine_log),
        runner=services.LazyRunner(),
        history=History(history_path()),
        lang=lang,
    )
    try:
        app.run()
    finally:
        app.stop_probes_now()
