"""The chat's widgets: the input, the status bar, and one view per conversation turn.

Widgets never call the engine or the runner: the app sets their state
(attributes down) and they post messages from assistant.tui.messages (up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.dom import DOMNode
from textual.reactive import reactive
from textual.widgets import Label, ListItem, ListView, Static, TextArea

from assistant.chat.conversation import Turn
from assistant.results import CauseResult, Finding, ProbeRun, Result
from assistant.tui.messages import CauseChosen, CopyFix, QuerySubmitted
from assistant.tui.present import (
    PROBE_MARKS,
    VERDICT_MARKS,
    cause_summary,
    cause_title,
    human_size,
    middle_cut,
    query_preview,
    seconds,
    verdict_counts,
)
from assistant.tui.strings import tr

# Pastes above this size are kept out of the editor (a 10 MB log would freeze
# the TextArea for seconds) and shown as one token that expands on send.
LARGE_PASTE_CHARS = 200_000
ROOT_ERROR_CHARS = 160  # about two lines at 80 columns; the export has it all

# Footer descriptions follow the interface language: binding id -> string key.
BINDING_TEXT = {
    "chat.send": "key.send",
    "chat.newline": "key.newline",
    "app.language": "key.language",
    "app.history": "key.history",
    "app.new": "key.new",
    "app.export": "key.export",
    "app.quit": "key.quit",
    "causes.open": "key.open",
    "causes.copy_fix": "key.copy_fix",
    "detail.back": "key.back",
    "detail.copy_fix": "key.copy_fix",
    "history.open": "key.reopen",
    "history.delete": "key.delete",
    "history.back": "key.back",
    "prompt.cancel": "key.cancel",
}


def line_count(text: str) -> int:
    """Lines in `text`, a final newline not starting another one."""
    return text.count("\n") + (0 if text.endswith("\n") or not text else 1)


def localize_bindings(node: DOMNode, lang: str) -> None:
    """Rewrite the footer descriptions of `node`'s bindings in `lang`.

    Textual has no public setter for a binding's description; each node owns
    a copy of its bindings map, so new lists are assigned (never mutated in
    place, which would leak into other instances of the class).
    """
    table = node._bindings.key_to_bindings
    for key, bindings in list(table.items()):
        table[key] = [
            dataclasses.replace(b, description=tr(BINDING_TEXT[b.id], lang))
            if b.id in BINDING_TEXT
            else b
            for b in bindings
        ]


class ChatInput(TextArea):
    """The multi-line question box: Enter sends, ctrl+j inserts a newline.

    A paste arrives as one event and stays one message with its newlines.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "Send", id="chat.send"),
        Binding("ctrl+j,shift+enter", "newline", "Newline", id="chat.newline"),
        Binding("tab", "app.focus_causes", "Causes", id="chat.causes", show=False),
    ]

    lang: reactive[str] = reactive("en")

    def __init__(self, *, id: str | None = None, cursor_blink: bool = True):
        super().__init__(id=id, soft_wrap=True, tab_behavior="focus", show_line_numbers=False)
        self.set_reactive(TextArea.cursor_blink, cursor_blink)
        self._attachments: dict[str, str] = {}

    def watch_lang(self, lang: str) -> None:
        self.placeholder = tr("input.placeholder", lang)
        localize_bindings(self, lang)

    async def _on_key(self, event: events.Key) -> None:
        # Textual calls TextArea._on_key after this one unless the default is
        # prevented. Keys bound to send/newline skip it (it would insert "\n"
        # for Enter) and reach the bindings, so a keymap can move them.
        if event.key in self._bound_keys():
            event.prevent_default()

    def _bound_keys(self) -> set[str]:
        return {key for key, b in self._bindings if b.action in ("submit", "newline")}

    async def _on_paste(self, event: events.Paste) -> None:
        if len(event.text) <= LARGE_PASTE_CHARS:
            return  # TextArea inserts it
        event.prevent_default()
        event.stop()
        token = tr(
            "input.large_paste",
            self.lang,
            number=len(self._attachments) + 1,
            lines=f"{line_count(event.text):,}",
            size=human_size(len(event.text)),
        )
        self._attachments[token] = event.text
        self.replace(token, *self.selection)
        self.focus()

    @property
    def message_text(self) -> str:
        """The text to send: the editor's text with large pastes put back in."""
        text = self.text
        for token, content in self._attachments.items():
            text = text.replace(token, content)
        return text

    def reset(self) -> None:
        """Empty the box after a send."""
        self._attachments.clear()
        self.clear()

    def action_submit(self) -> None:
        self.post_message(QuerySubmitted(self.message_text))

    def action_newline(self) -> None:
        self.replace("\n", *self.selection)


@dataclass
class ModelState:
    """What the status bar says about the engine."""

    phase: str = "loading"  # loading | ready | failed
    error: str = ""
    started: float = 0.0
    note: str = ""  # the latest engine log line or background task


class StatusBar(Static):
    """One line at the top: app name, model state, background task, language."""

    lang: reactive[str] = reactive("en")

    def __init__(self, clock: Callable[[], float], *, id: str | None = None):
        super().__init__(id=id)
        self.clock = clock
        self.state = ModelState(started=clock())

    def set_state(self, **changes) -> None:
        self.state = dataclasses.replace(self.state, **changes)
        self.refresh_view()

    def watch_lang(self, lang: str) -> None:
        self.refresh_view()

    def refresh_view(self) -> None:
        lang = self.lang
        line = Text()
        line.append(tr("app.title", lang), style="bold")
        line.append("  ")
        state = self.state
        if state.phase == "ready":
            line.append("● " + tr("model.ready", lang), style="green")
        elif state.phase == "failed":
            line.append("● " + tr("model.failed", lang, error=state.error), style="red")
        else:
            waited = int(max(self.clock() - state.started, 0))
            line.append("◌ " + tr("model.loading", lang, seconds=waited), style="yellow")
        if state.note:
            line.append("  ·  " + state.note, style="dim")
        line.append("  ·  " + tr("lang.name", lang), style="dim")
        self.update(line)


# -- one conversation turn ------------------------------------------------------


@dataclass
class ProbeRow:
    """How one probe of a turn is doing."""

    name: str
    state: str = "waiting"  # waiting | running | done
    started: float = 0.0  # app clock when it started
    started_at_run: float = 0.0  # runner's elapsed-since-run-start when it started
    elapsed: float = 0.0
    status: str = ""
    reused: bool = False


class CauseItem(ListItem):
    """One candidate cause: rank, verdict mark, title, verdict, first evidence line."""

    def __init__(self, number: int, cause: CauseResult, lang: str):
        super().__init__(classes=f"cause verdict-{cause.verdict.verdict}")
        self.number = number
        self.cause = cause
        self.lang = lang

    def compose(self) -> ComposeResult:
        with Horizontal(classes="cause-head"):
            yield Label(classes="cause-title")
            yield Label(classes="cause-verdict")
        yield Label(classes="cause-detail")

    def on_mount(self) -> None:
        self.refresh_view()

    def refresh_view(self) -> None:
        cause, lang = self.cause, self.lang
        verdict = cause.verdict.verdict
        mark = VERDICT_MARKS.get(verdict, "·")
        self.query_one(".cause-title", Label).update(
            Text(f"{self.number}. {mark} {cause_title(cause, lang)}")
        )
        # Doctor results are not ranked by a query: no score to show.
        score = f"  {cause.score:.2f}" if cause.score > 0 else ""
        self.query_one(".cause-verdict", Label).update(Text(tr(f"verdict.{verdict}", lang) + score))
        detail = cause.verdict.evidence[0] if cause.verdict.evidence else cause_summary(cause, lang)
        self.query_one(".cause-detail", Label).update(Text(detail))


class CauseList(ListView):
    """The causes of one turn, best first; Enter opens one, c copies its fix."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Open cause", id="causes.open"),
        Binding("c", "copy_fix", "Copy fix", id="causes.copy_fix"),
        Binding("escape", "app.focus_input", "Back to input", id="causes.input", show=False),
    ]

    @property
    def highlighted_cause(self) -> CauseResult | None:
        item = self.highlighted_child
        return item.cause if isinstance(item, CauseItem) else None

    def action_copy_fix(self) -> None:
        cause = self.highlighted_cause
        if cause is not None:
            self.post_message(CopyFix(cause))


class TurnView(Vertical):
    """One turn: the question, its root error, causes, probes and findings."""

    lang: reactive[str] = reactive("en")

    def __init__(self, key: int, turn: Turn, clock: Callable[[], float], lang: str):
        super().__init__(id=f"turn-{key}", classes="turn")
        self.key = key  # unique for the app's lifetime; messages name turns by it
        self.turn = turn
        self.clock = clock
        self.phase = "searching"  # waiting_model | searching | linting | probing | done | failed
        self._preview = query_preview(turn.query)  # once: the query may be a 10 MB log
        self.error = ""
        self.probe_rows: dict[str, ProbeRow] = {}
        self.set_reactive(TurnView.lang, lang)

    def compose(self) -> ComposeResult:
        # A pasted log is summed up on one line; a typed question may wrap.
        yield Static(classes="turn-query -log" if self._preview[1] else "turn-query")
        yield Static(classes="turn-status")
        yield Static(classes="turn-root")
        yield CauseList(classes="turn-causes")
        yield Static(classes="turn-probes")
        yield Static(classes="turn-findings")

    def on_mount(self) -> None:
        localize_bindings(self.causes, self.lang)
        self.refresh_view()

    def watch_lang(self, lang: str) -> None:
        if self.is_mounted:
            localize_bindings(self.causes, lang)
            for item in self.causes.query(CauseItem):
                item.lang = lang
                item.refresh_view()
            self.refresh_view()

    @property
    def causes(self) -> CauseList:
        return self.query_one(CauseList)

    # -- state set by the app ---------------------------------------------------

    def set_phase(self, phase: str, error: str = "") -> None:
        self.phase, self.error = phase, error
        self.refresh_view()

    async def show_result(self, result: Result) -> None:
        """Show (or re-rank) the causes of this turn, keeping the highlighted one."""
        self.turn.result = result
        if not self.is_attached:
            return  # the app is closing or the conversation was replaced
        causes = self.causes
        # Keep the person's place only if they are in the list; otherwise the
        # top (now the best-confirmed) cause is the one to look at.
        keep = (
            causes.highlighted_cause.id if causes.has_focus and causes.highlighted_cause else None
        )
        await causes.clear()
        items = [CauseItem(n, c, self.lang) for n, c in enumerate(result.causes, 1)]
        await causes.extend(items)
        ids = [c.id for c in result.causes]
        if items:
            causes.index = ids.index(keep) if keep in ids else 0
        self.refresh_view()

    def expect_probes(self, names: list[str], reused: dict) -> None:
        """List the probes this turn will run; reused ones show their earlier outcome."""
        self.probe_rows = {}
        for name in names:
            row = ProbeRow(name)
            if name in reused:
                run = reused[name]
                row = ProbeRow(name, "done", elapsed=run.seconds, status=run.status, reused=True)
            self.probe_rows[name] = row
        self.refresh_view()

    def probe_event(self, probe: str, state: str, elapsed: float, status: str | None) -> None:
        """A runner progress event; `elapsed` counts from the start of the run."""
        row = self.probe_rows.setdefault(probe, ProbeRow(probe))
        if state == "started":
            row.state, row.started, row.started_at_run = "running", self.clock(), elapsed
        else:
            took = max(elapsed - row.started_at_run, 0.0)
            row.state, row.elapsed, row.status = "done", took, status or "ok"
        self.refresh_view()

    def probe_finished(self, run: ProbeRun) -> None:
        """The final outcome of a probe, with its own duration."""
        row = self.probe_rows.setdefault(run.name, ProbeRow(run.name))
        row.state, row.elapsed, row.status = "done", run.seconds, run.status
        self.refresh_view()

    def finish_rows(self, status: str) -> None:
        """Close the rows of probes that never reported back (stopped, or the run failed)."""
        for row in self.probe_rows.values():
            if row.state != "done":
                took = self.clock() - row.started if row.state == "running" else 0.0
                row.state, row.status, row.elapsed = "done", status, max(took, 0.0)
        self.refresh_view()

    async def restore(self) -> None:
        """Show a turn loaded from the history as it ended."""
        turn = self.turn
        if turn.result is not None:
            await self.show_result(turn.result)
            for run in turn.result.probes:
                self.probe_rows[run.name] = ProbeRow(
                    run.name, "done", elapsed=run.seconds, status=run.status
                )
        if turn.error and turn.result is None:
            self.set_phase("failed", turn.error)
        else:
            self.set_phase("done")

    @property
    def running(self) -> bool:
        return any(row.state == "running" for row in self.probe_rows.values())

    # -- rendering ----------------------------------------------------------------

    def refresh_view(self) -> None:
        if not self.is_mounted:
            return
        self.query_one(".turn-query", Static).update(self._query_text())
        self.query_one(".turn-status", Static).update(self._status_text())
        root = self.turn.root_error
        root_widget = self.query_one(".turn-root", Static)
        root_widget.display = root is not None
        if root is not None:
            where = f" (rank {root.rank})" if root.rank is not None else ""
            line = Text(tr("root_error", self.lang) + where + "  ", style="bold")
            message = middle_cut(root.message, ROOT_ERROR_CHARS)
            line.append(f"{root.type}: {message}", style="red")
            root_widget.update(line)
        self.causes.display = bool(self.turn.result and self.turn.result.causes)
        probes = self.query_one(".turn-probes", Static)
        probes.display = bool(self.probe_rows)
        if self.probe_rows:
            probes.update(self._probe_text())
        findings = self.query_one(".turn-findings", Static)
        findings.display = self.turn.kind == "lint" and self.phase == "done"
        if findings.display:
            findings.update(self._findings_text(self.turn.findings))

    def _query_text(self) -> Text:
        turn, lang = self.turn, self.lang
        if turn.kind == "doctor":
            return Text("› " + tr("turn.doctor", lang), style="bold")
        if turn.kind == "lint":
            return Text("› " + tr("turn.lint", lang, path=turn.query), style="bold")
        head, more = self._preview
        line = Text("› ", style="bold")
        if more:
            line.append(tr("turn.lines", lang, count=f"{more + 1:,}") + " ", style="dim")
        line.append(head, style="bold")
        return line

    def _status_text(self) -> Text:
        lang = self.lang
        if self.phase == "failed":
            return Text(tr("turn.error", lang, error=self.error), style="red")
        if self.phase == "waiting_model":
            return Text(tr("turn.waiting_model", lang), style="yellow")
        if self.phase == "searching":
            return Text(tr("turn.searching", lang), style="yellow")
        if self.phase == "linting":
            return Text(tr("turn.linting", lang), style="yellow")
        result = self.turn.result
        if self.phase == "probing":
            finished = sum(row.state == "done" for row in self.probe_rows.values())
            text = Text(
                tr("turn.probing", lang, done=finished, count=len(self.probe_rows)), style="yellow"
            )
        elif result is not None and self.turn.kind != "lint":
            text = Text(tr("turn.done", lang, **verdict_counts(result.causes)), style="green")
            if not self.probe_rows and self.turn.kind == "ask":
                text.append("  " + tr("turn.no_probes", lang), style="dim")
        else:
            text = Text()
        if self.error:
            text.append(("  " if text.plain else "") + self.error, style="red")
        if result is not None and result.causes and self.turn.kind != "lint":
            text.append((" · " if text.plain else "") + tr("turn.open_hint", lang), style="dim")
        return text

    def _probe_text(self) -> Text:
        lang = self.lang
        text = Text(tr("probe.label", lang) + "  ", style="bold")
        for number, row in enumerate(self.probe_rows.values()):
            if number:
                text.append("  ·  ", style="dim")
            if row.state == "waiting":
                text.append(f"… {row.name} {tr('probe.waiting', lang)}", style="dim")
            elif row.state == "running":
                took = seconds(max(self.clock() - row.started, 0.0))
                text.append(f"⟳ {row.name} {tr('probe.running', lang, seconds=took)}", "yellow")
            else:
                mark = PROBE_MARKS.get(row.status, "?")
                style = "green" if row.status in ("ok", "not_applicable") else "red"
                label = tr(f"probe.status.{row.status}", lang)
                note = f" ({tr('probe.reused', lang)})" if row.reused else ""
                text.append(f"{mark} {row.name} {label} {seconds(row.elapsed)}{note}", style)
        return text

    def _findings_text(self, findings: list[Finding]) -> Text:
        lang, path = self.lang, self.turn.query
        if not findings:
            return Text(tr("lint.none", lang, path=path), style="green")
        text = Text(tr("lint.found", lang, count=len(findings), path=path), style="bold")
        for finding in findings:
            text.append(f"\n  line {finding.line}  ", style="dim")
            text.append(finding.cause_id, style="cyan")
            text.append(f"  {finding.message}")
        return text

    # -- messages up ----------------------------------------------------------------

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, CauseItem):
            self.post_message(CauseChosen(self.key, event.item.cause))
