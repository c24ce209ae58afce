"""The chat's history actions: save, browse, reopen, delete, clear, and the privacy notice.

A mixin of ChatApp (assistant.tui.app): it uses the app's `deps`, `tell`,
`conversation` and `show_conversation`. The reads and writes themselves are
assistant.chat.history's.
"""

from __future__ import annotations

from textual import work

from assistant.tui.messages import (
    ClearHistory,
    ConversationChosen,
    ConversationDeleted,
    HistoryChecked,
)
from assistant.tui.present import one_line
from assistant.tui.screens import ConfirmDialog, HistoryScreen
from assistant.tui.strings import tr


class HistoryActions:
    """Everything the chat does with its history."""

    # history

    @work(thread=True, group="history", exit_on_error=False)
    def check_history(self) -> None:
        """Open the history file off the UI thread (this also pays sqlite-utils' import)."""
        try:
            self.deps.history.list(limit=1)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.post_message(HistoryChecked(one_line(exc)))
        else:
            self.post_message(HistoryChecked())

    def on_history_checked(self, message: HistoryChecked) -> None:
        if message.error and not self.history_error:
            self.history_error = message.error
            self.tell(tr("history.unavailable", self.lang, error=message.error))

    def save(self) -> None:
        """Store the conversation in the history (quietly off when it cannot be opened).

        The first time anything is written, say once what is kept and where.
        """
        history = self.deps.history
        if history is None or self.history_error or not self.conversation.turns:
            return
        try:
            history.save(self.conversation, now=self.deps.now())
            if history.notice_due():
                self.tell(tr("history.notice", self.lang, path=history.path), timeout=20)
                history.mark_notice_shown()
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.history_error = one_line(exc)
            self.tell(tr("history.unavailable", self.lang, error=self.history_error))

    def history_entries(self) -> list | None:
        if self.deps.history is None:
            off = tr("history.off", self.lang) if self.deps.history_off else None
            self.tell(off or tr("history.unavailable", self.lang, error="-"), severity="warning")
            return None
        try:
            return self.deps.history.list()
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.tell(tr("history.unavailable", self.lang, error=one_line(exc)))
            return None

    def action_history(self) -> None:
        entries = self.history_entries()
        if entries is not None:
            self.push_screen(HistoryScreen(entries, self.lang, self.deps.format_time))

    async def on_conversation_chosen(self, message: ConversationChosen) -> None:
        try:
            conversation = self.deps.history.load(message.conversation_id)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.tell(one_line(exc), severity="error")
            return
        if isinstance(self.screen, HistoryScreen):
            self.pop_screen()
        await self.show_conversation(conversation)

    async def on_conversation_deleted(self, message: ConversationDeleted) -> None:
        try:
            self.deps.history.delete(message.conversation_id)
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.tell(one_line(exc), severity="error")
            return
        if self.conversation.id == message.conversation_id:
            self.conversation.id = None  # still on screen; saved again as new if it changes
        self.tell(tr("history.deleted", self.lang))
        await self.refresh_history_screen()

    async def refresh_history_screen(self) -> None:
        if isinstance(self.screen, HistoryScreen):
            entries = self.history_entries()
            if entries is not None:
                await self.screen.set_entries(entries)

    def action_clear_history(self) -> None:
        """Delete every saved conversation, after a confirmation."""
        entries = self.history_entries()
        if entries is None:
            return
        question = tr("history.confirm_clear", self.lang, count=len(entries))
        self.push_screen(ConfirmDialog(question, self.lang), callback=self.clear_history)

    def on_clear_history(self, message: ClearHistory) -> None:
        self.action_clear_history()

    async def clear_history(self, yes: bool | None) -> None:
        if not yes:
            return
        try:
            self.deps.history.clear()
        except Exception as exc:  # noqa: BLE001 - shown, never raised into the UI
            self.tell(one_line(exc), severity="error")
            return
        self.conversation.id = None  # what is on screen is saved again only if it changes
        self.tell(tr("history.cleared", self.lang))
        await self.refresh_history_screen()
