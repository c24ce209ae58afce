"""The history keeps pasted logs: private file, a one-time notice, a way out, a way to clear it."""

from __future__ import annotations

import stat

import pytest
from click.testing import CliRunner
from test_tui_fakes import DUPLICATE_GPU_LINE, ask, fake_app, run_command, until

from assistant.chat.history import History, history_enabled
from assistant.tui.screens import ConfirmDialog, HistoryScreen

pytestmark = pytest.mark.anyio


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_history_is_private_and_the_notice_is_shown_once(tmp_path):
    path = tmp_path / "new-folder" / "history.sqlite"
    app = fake_app(history=History(path))
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        await ask(app, pilot, "and now?")
        notices = [n for n in app.notices if "kept on this machine" in n]
        assert len(notices) == 1  # once, though the conversation was saved many times
        assert str(path) in notices[0] and "--no-history" in notices[0]
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    # A new session on the same file: already told.
    app = fake_app(history=History(path))
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert not [n for n in app.notices if "kept on this machine" in n]


async def test_a_world_readable_history_file_is_made_private(tmp_path):
    path = tmp_path / "history.sqlite"
    folder_mode = mode(tmp_path)
    History(path).list()
    path.chmod(0o644)
    History(path).list()
    assert mode(path) == 0o600
    assert mode(tmp_path) == folder_mode  # a folder we did not create is left alone


async def test_without_history_nothing_is_written_and_the_history_says_why(tmp_path):
    app = fake_app(history=None, history_off=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert not isinstance(app.screen, HistoryScreen)
        assert "History is off for this session" in app.notices[-1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "enabled"), [("", True), ("0", True), ("1", False), ("true", False), ("YES", False)]
)
def test_assistant_no_history_turns_it_off(value, enabled):
    assert history_enabled({"ASSISTANT_NO_HISTORY": value}) is enabled


@pytest.mark.parametrize(
    ("keep", "env", "kept"), [(True, "", True), (False, "", False), (True, "1", False)]
)
def test_run_chat_builds_the_chat_without_history_when_asked(
    monkeypatch, tmp_path, keep, env, kept
):
    from assistant.tui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.ChatApp, "run", lambda self: seen.setdefault("deps", self.deps))
    monkeypatch.setenv("ASSISTANT_HISTORY", str(tmp_path / "h.sqlite"))
    monkeypatch.setenv("ASSISTANT_NO_HISTORY", env)
    app_module.run_chat(keep_history=keep)
    deps = seen["deps"]
    assert (deps.history is not None) is kept and deps.history_off is (not kept)
    # Answers are kept for feedback exactly when the history is (no answer_id otherwise).
    assert (deps.answers is not None) is kept
    assert list(tmp_path.iterdir()) == []  # nothing written before the first question


def test_the_chat_command_offers_no_history():
    from assistant.cli import main

    result = CliRunner().invoke(main, ["chat", "--help"])
    assert result.exit_code == 0 and "--no-history" in result.output


async def test_clearing_the_history_from_the_palette_asks_first(tmp_path):
    history = History(tmp_path / "history.sqlite")
    app = fake_app(history=history)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert len(history.list()) == 1
        await run_command(app, pilot, "clear history")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("n")  # keeps
        await pilot.pause()
        assert len(history.list()) == 1 and not isinstance(app.screen, ConfirmDialog)
        await run_command(app, pilot, "clear history")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await until(pilot, lambda: history.list() == [])
        assert "History cleared." in app.notices
        # What is still on screen is saved again (as new) only when it changes.
        await ask(app, pilot, "still broken")
        assert len(history.list()) == 1


async def test_clearing_the_history_from_its_screen_asks_first(tmp_path):
    history = History(tmp_path / "history.sqlite")
    app = fake_app(history=history)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        await pilot.press("ctrl+r")
        assert isinstance(app.screen, HistoryScreen)
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, HistoryScreen) and len(history.list()) == 1
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await until(pilot, lambda: history.list() == [])
        assert isinstance(app.screen, HistoryScreen)
        assert not app.screen.query_one("#history-list").display
