"""A chat run turn reopened from the history shows its job's output and rank lines again.

A real job (a Python process that prints and raises) under the real watcher,
the real history SQLite file, and a second app that reads it back.
"""

from __future__ import annotations

import shlex
import sys

import pytest
from test_tui_fakes import fake_app, run_command, until, widget_text
from textual.widgets import Input, Static

from assistant.chat.history import History
from assistant.tui.screens import HistoryScreen, PathPrompt

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

JOB = (
    "import sys; print('hello from the job'); print('  indented line', flush=True); "
    "raise ValueError('boom in the job')"
)


def part(view, name: str) -> str:
    return widget_text(view.query_one(f".turn-{name}", Static))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """The run's log folder (and its pruning) in a cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


async def test_a_run_turn_reopened_from_the_history_shows_its_output_and_ranks(
    tmp_path, private_cache
):
    path = tmp_path / "history.sqlite"
    app = fake_app(run_probe=False, history=History(path))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.model_phase == "ready")
        await run_command(app, pilot, "run a launch")
        await until(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = shlex.join([sys.executable, "-c", JOB])
        await pilot.press("enter")
        await until(pilot, lambda: bool(app.turn_views))
        live = app.turn_views[-1]
        await until(pilot, lambda: live.phase in ("done", "failed"), timeout=120)
        assert live.phase == "done", live.error
        output, ranks, status = part(live, "output"), part(live, "ranks"), part(live, "status")
        assert "hello from the job" in output and "  indented line" in output
        assert "ValueError: boom in the job" in ranks and "logs: " in ranks

    # Another chat, later: the same file, the conversation reopened from the list.
    again = fake_app(run_probe=False, history=History(path))
    async with again.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+r")
        await until(pilot, lambda: isinstance(again.screen, HistoryScreen))
        await pilot.press("enter")
        await until(pilot, lambda: not isinstance(again.screen, HistoryScreen))
        [restored] = again.turn_views
        await pilot.pause()
        assert restored.phase == "done"
        assert part(restored, "output") == output
        assert part(restored, "ranks") == ranks
        assert part(restored, "status") == status
        assert restored.turn.result is not None and restored.turn.root_error.type == "ValueError"
