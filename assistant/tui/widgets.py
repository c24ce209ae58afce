"""The chat's input box and status bar (the conversation turns are in assistant.tui.turn).

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
from textual.binding import BindingType
from textual.reactive import reactive
from textual.widgets import Static, TextArea

from assistant.tui.keys import LocalizedBindings, bilingual
from assistant.tui.messages import QuerySubmitted
from assistant.tui.present import human_size, line_count
from assistant.tui.strings import tr

# Pastes above this size are kept out of the editor (a 10 MB log would freeze
# the TextArea for seconds) and shown as one token that expands on send.
LARGE_PASTE_CHARS = 200_000
# Actions whose keys the editor must not also insert ("\n" for Enter).
INPUT_ACTIONS = ("submit", "newline")


class ChatInput(LocalizedBindings, TextArea):
    """The multi-line question box: Enter sends, ctrl+j inserts a newline.

    A paste arrives as one event and stays one message with its newlines.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        *bilingual("enter", "submit", "key.send", "chat.send"),
        *bilingual("ctrl+j,shift+enter", "newline", "key.newline", "chat.newline"),
        *bilingual("tab", "app.focus_causes", "key.causes", "chat.causes", show=False),
    ]

    lang: reactive[str] = reactive("en")

    def __init__(self, *, id: str | None = None, cursor_blink: bool = True):
        super().__init__(id=id, soft_wrap=True, tab_behavior="focus", show_line_numbers=False)
        self.set_reactive(TextArea.cursor_blink, cursor_blink)
        self.attachments: dict[str, str] = {}

    def watch_lang(self, lang: str) -> None:
        self.placeholder = tr("input.placeholder", lang)

    async def on_key(self, event: events.Key) -> None:
        # TextArea's own key handler runs after this one unless the default is
        # prevented; keys bound to send/newline skip it (it would insert "\n"
        # for Enter) and reach the bindings, so a keymap can move them.
        if event.key in self.input_keys():
            event.prevent_default()

    def input_keys(self) -> set[str]:
        """The keys that currently send or insert a newline here (keymaps included)."""
        return {
            key
            for key, active in self.app.active_bindings.items()
            if active.node is self and any(name in active.binding.action for name in INPUT_ACTIONS)
        }

    async def on_paste(self, event: events.Paste) -> None:
        if len(event.text) <= LARGE_PASTE_CHARS:
            return  # TextArea inserts it
        event.prevent_default()
        event.stop()
        lines = line_count(event.text)
        token = tr(
            "input.large_paste" if lines != 1 else "input.large_paste_one_line",
            self.lang,
            number=len(self.attachments) + 1,
            lines=f"{lines:,}",
            size=human_size(len(event.text)),
        )
        self.attachments[token] = event.text
        self.replace(token, *self.selection)
        self.focus()

    @property
    def message_text(self) -> str:
        """The text to send: the editor's text with large pastes put back in."""
        text = self.text
        for token, content in self.attachments.items():
            text = text.replace(token, content)
        return text

    def type_in(self, text: str) -> None:
        """Insert typed text at the cursor and take the focus (keys typed elsewhere)."""
        self.focus()
        self.replace(text, *self.selection)

    def reset(self) -> None:
        """Empty the box after a send."""
        self.attachments.clear()
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
