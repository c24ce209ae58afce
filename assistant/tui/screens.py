"""Screens pushed over the chat: a cause in full, the history, a path prompt, a confirmation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from rich.console import Group
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Label, ListItem, ListView, OptionList, Static
from textual.widgets.option_list import Option

from assistant.i18n import (
    asked_for,
    cause_summary,
    cause_title,
    community_stance,
    entry_text,
    here_outcome,
    stance_label,
    t,
    verdict_label,
)
from assistant.results import AnswerRef, CauseResult, Finding
from assistant.tui.keys import LocalizedBindings, bilingual
from assistant.tui.messages import (
    ClearHistory,
    ConversationChosen,
    ConversationDeleted,
    CopyFix,
    Notice,
)
from assistant.tui.present import VERDICT_MARKS, split_answers
from assistant.tui.strings import tr

if TYPE_CHECKING:
    from assistant.chat.history import ConversationSummary

STANCE_STYLES = {
    "right": "green",
    "partly_right": "yellow",
    "unverified": "dim",
    "wrong": "red",
}
HERE_STYLES = {"confirmed_here": "bold green", "refuted_here": "bold red"}
VERDICT_STYLES = {
    "confirmed": "bold green",
    "ruled_out": "red",
    "inconclusive": "yellow",
    "not_applicable": "dim",
    "not_run": "dim",
}


def section(title: str) -> Text:
    return Text(title, style="bold underline")


class CauseScreen(LocalizedBindings, Screen):
    """Everything about one cause: why, evidence, community answers, fix, references.

    It speaks the language of the turn the cause belongs to.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("escape", "back", "key.back", "detail.back"),
        *bilingual("c", "copy_fix", "key.copy_fix", "detail.copy_fix"),
    ]

    lang: reactive[str] = reactive("en")

    def __init__(self, cause: CauseResult, lang: str, findings: list[Finding] | None = None):
        super().__init__(id="cause-screen")
        self.cause = cause
        self.findings = list(findings or [])
        self.entry: dict | None = None
        self.entry_error = ""
        self.entry_pending = True
        self.set_reactive(CauseScreen.lang, lang)

    def compose(self) -> ComposeResult:
        yield Static(id="detail-header")
        with VerticalScroll(id="detail-body"):
            yield Static(id="detail-top")
            with Horizontal(id="answers"):
                yield Static(id="answers-agreeing", classes="answers-column")
                yield Static(id="answers-contradicting", classes="answers-column")
            yield Static(id="detail-fix")
            yield Static(id="fix-code")
            yield Static(id="detail-bottom")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()
        self.query_one("#detail-body").focus()

    def watch_lang(self, lang: str) -> None:
        if self.is_mounted:
            self.refresh_view()

    def set_entry(self, entry: dict | None, error: str = "") -> None:
        """The full KB entry arrived (or could not be read: `error`)."""
        self.entry, self.entry_error, self.entry_pending = entry, error, False
        self.refresh_view()

    def action_back(self) -> None:
        self.dismiss()

    def action_copy_fix(self) -> None:
        self.post_message(CopyFix(self.cause, self.entry))

    # -- rendering ----------------------------------------------------------------

    def refresh_view(self) -> None:
        cause, lang, entry = self.cause, self.lang, self.entry or {}
        verdict = cause.verdict.verdict
        label = verdict_label(cause, lang, self.findings)
        header = Text(f"{VERDICT_MARKS.get(verdict, '·')} {label}  ")
        header.stylize(VERDICT_STYLES.get(verdict, ""))
        header.append(cause_title(cause, lang), style="bold")
        header.append(f"  ({cause.id})", style="dim")
        self.query_one("#detail-header", Static).update(header)
        self.query_one("#detail-top", Static).update(self._top(entry))
        agreeing, contradicting = split_answers(cause.answers)
        self.query_one("#answers").display = bool(cause.answers)
        self.query_one("#answers-agreeing", Static).update(
            self._answers(tr("detail.agreeing", lang), agreeing)
        )
        self.query_one("#answers-contradicting", Static).update(
            self._answers(tr("detail.contradicting", lang), contradicting)
        )
        self.query_one("#detail-fix", Static).update(self._fix(entry))
        code = (entry.get("fix_code") or cause.fix_code or "").rstrip()
        code_widget = self.query_one("#fix-code", Static)
        code_widget.display = bool(code)
        if code:
            code_widget.update(Syntax(code, "python", theme="monokai", word_wrap=True))
        self.query_one("#detail-bottom", Static).update(self._bottom(entry))

    def _top(self, entry: dict) -> Group:
        cause, lang = self.cause, self.lang
        parts: list = []
        if self.entry_pending:
            parts.append(Text(tr("detail.loading", lang), style="dim italic"))
        elif self.entry_error:
            parts.append(Text(tr("detail.partial", lang, error=self.entry_error), style="yellow"))
        summary = entry_text(entry, "summary", lang) or cause_summary(cause, lang)
        parts += [section(tr("detail.summary", lang)), Text(summary.strip()), Text()]
        parts.append(section(t("evidence", lang)))
        if cause.verdict.evidence:
            parts.extend(Text(f"• {line}") for line in cause.verdict.evidence)
        else:
            parts.append(Text(tr("detail.no_evidence", lang), style="dim"))
        parts.append(Text())
        why = entry_text(entry, "why", lang)
        if why:
            parts += [section(t("why", lang)), Text(why.strip()), Text()]
        parts.append(section(t("answers", lang)))
        if not cause.answers:
            parts.append(Text(tr("detail.no_answers", lang), style="dim"))
        return Group(*parts)

    def _answers(self, title: str, answers: list[AnswerRef]) -> Group:
        lang = self.lang
        parts: list = [Text(title, style="bold")]
        if not answers:
            parts.append(Text(tr("detail.none", lang), style="dim"))
        for answer in answers:
            badge = answer_badge(answer, lang)
            name = f" #{answer.answer_id}" if answer.answer_id else ""
            parts.append(badge + Text(name, style="dim"))
            question = asked_for(answer, lang)
            if question:
                parts.append(Text(question, style="dim"))
            parts.append(Text(answer.text.strip()))
            if answer.note:
                parts.append(Text(answer.note.strip(), style="dim italic"))
            parts.append(Text())
        return Group(*parts)

    def _fix(self, entry: dict) -> Group:
        lang = self.lang
        fix = entry_text(entry, "fix", lang) or self.cause.fix
        return Group(Text(), section(t("fix", lang)), Text(fix.strip()))

    def _bottom(self, entry: dict) -> Group:
        lang = self.lang
        parts: list = []
        risks = entry_text(entry, "risks", lang)
        if risks:
            parts += [Text(), section(t("risks", lang)), Text(risks.strip())]
        references = entry.get("references") or []
        if references:
            parts += [Text(), section(t("references", lang))]
            for ref in references:
                line = Text("• ")
                line.append(str(ref.get("title", "")), style=f"link {ref.get('url', '')}")
                line.append(f"  {ref.get('url', '')}", style="dim")
                parts.append(line)
        return Group(*parts)


class HistoryItem(ListItem):
    """One saved conversation in the history list."""

    def __init__(self, entry: ConversationSummary, label: Text):
        super().__init__(Label(label))
        self.entry = entry


class HistoryList(LocalizedBindings, ListView):
    """Saved conversations; Enter reopens one, d twice deletes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("enter", "select_cursor", "key.reopen", "history.open"),
        *bilingual("d,delete", "delete", "key.delete", "history.delete"),
    ]

    def __init__(self, *args, lang: str = "en", **kwargs):
        super().__init__(*args, **kwargs)
        self.lang = lang
        self.armed: str | None = None  # the conversation a first `d` asked about

    def action_delete(self) -> None:
        """A deletion cannot be undone: the first press asks, the second deletes."""
        item = self.highlighted_child
        if not isinstance(item, HistoryItem):
            return
        if self.armed != item.entry.id:
            self.armed = item.entry.id
            self.post_message(Notice(tr("history.confirm_delete", self.lang), "warning"))
            return
        self.armed = None
        self.post_message(ConversationDeleted(item.entry.id))

    def watch_index(self, old_index: int | None, new_index: int | None) -> None:
        super().watch_index(old_index, new_index)
        self.armed = None  # moving on cancels a pending deletion


class HistoryScreen(LocalizedBindings, Screen):
    """Browse, reopen and delete saved conversations; x clears them all (asks first)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("escape", "back", "key.back", "history.back"),
        *bilingual("x", "clear", "key.clear", "history.clear"),
    ]

    def __init__(
        self,
        entries: list[ConversationSummary],
        lang: str,
        format_time: Callable[[float], str],
    ):
        super().__init__(id="history-screen")
        self.entries = entries
        self.lang = lang
        self.format_time = format_time  # ChatDeps.format_time

    def compose(self) -> ComposeResult:
        yield Static(tr("history.title", self.lang), id="history-title")
        yield HistoryList(id="history-list", lang=self.lang)
        yield Static(tr("history.empty", self.lang), id="history-empty")
        yield Footer()

    async def on_mount(self) -> None:
        await self.set_entries(self.entries)
        self.query_one(HistoryList).focus()

    async def set_entries(self, entries: list[ConversationSummary]) -> None:
        """Show `entries` (newest first), keeping the cursor near where it was."""
        self.entries = entries
        listing = self.query_one(HistoryList)
        old_index = listing.index or 0
        await listing.clear()
        await listing.extend(HistoryItem(e, self._label(e)) for e in entries)
        if entries:
            listing.index = min(old_index, len(entries) - 1)
        listing.display = bool(entries)
        self.query_one("#history-empty").display = not entries

    def _label(self, entry: ConversationSummary) -> Text:
        label = Text(self.format_time(entry.updated), style="dim")
        label.append(f"  {tr('history.turns', self.lang, count=entry.turns):<9}  ", style="dim")
        label.append(entry.title or "-")
        return label

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, HistoryItem):
            self.post_message(ConversationChosen(event.item.entry.id))

    def action_back(self) -> None:
        self.dismiss()

    def action_clear(self) -> None:
        if self.entries:
            self.post_message(ClearHistory())


def answer_badge(answer: AnswerRef, lang: str) -> Text:
    """The community stance (and the question it was given for) with the machine's outcome."""
    label = stance_label(answer, lang, with_question=False)
    outcome = here_outcome(answer)
    style = HERE_STYLES.get(outcome) or STANCE_STYLES.get(community_stance(answer), "")
    badge = Text(label, style)
    if outcome == "refuted_here":
        badge = Text("✘ ", "bold red") + badge
    elif outcome == "confirmed_here":
        badge = Text("✔ ", "bold green") + badge
    return badge


class PathPrompt(LocalizedBindings, ModalScreen[str | None]):
    """Ask for a path (a script to lint, a folder for the report) or a command line.

    Dismisses with the text typed, or None.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("escape", "cancel", "key.cancel", "prompt.cancel")
    ]

    def __init__(
        self,
        lang: str,
        prompt_key: str = "lint.prompt",
        placeholder: str = "train.py",
        value: str = "",
        hint_key: str = "lint.prompt_hint",
        empty_key: str = "lint.empty_path",
    ):
        super().__init__(id="path-prompt")
        self.lang = lang
        self.prompt_key = prompt_key
        self.placeholder = placeholder
        self.value = value
        self.hint_key = hint_key
        self.empty_key = empty_key

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box"):
            yield Label(tr(self.prompt_key, self.lang))
            yield Input(value=self.value, placeholder=self.placeholder, id="path-input")
            yield Label("", id="prompt-error")
            yield Label(tr(self.hint_key, self.lang), id="prompt-hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        path = event.value.strip()
        if not path:
            self.query_one("#prompt-error", Label).update(tr(self.empty_key, self.lang))
            return
        self.dismiss(path)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(LocalizedBindings, ModalScreen[bool]):
    """A yes/no question about something that cannot be undone; dismisses with True for yes."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("y", "answer(True)", "key.yes", "confirm.yes"),
        *bilingual("n,escape", "answer(False)", "key.no", "confirm.no"),
    ]

    def __init__(self, question: str, lang: str):
        super().__init__(id="confirm-dialog")
        self.question = question
        self.lang = lang

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box"):
            yield Label(self.question, id="confirm-question")
            yield Label(tr("confirm.hint", self.lang), id="prompt-hint")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ExportChoice(LocalizedBindings, ModalScreen[str | None]):
    """Where to put a report the chosen folder could not take.

    Dismisses with "other", "home" or "clipboard" (None when cancelled).
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("escape", "cancel", "key.cancel", "export.cancel")
    ]

    def __init__(self, reason: str, home: str, lang: str):
        super().__init__(id="export-choice")
        self.reason = reason
        self.home = home
        self.lang = lang

    def compose(self) -> ComposeResult:
        lang = self.lang
        with Vertical(id="prompt-box"):
            yield Label(self.reason, id="export-reason")
            yield OptionList(
                Option(tr("export.home", lang, path=self.home), id="home"),
                Option(tr("export.other_path", lang), id="other"),
                Option(tr("export.clipboard", lang), id="clipboard"),
                id="export-options",
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
