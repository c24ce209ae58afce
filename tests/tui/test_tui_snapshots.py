"""Snapshots of the main screens at 80x24 and 120x40 (pytest-textual-snapshot).

Nothing that varies between runs reaches the screen: the clock is fixed, the
cursor does not blink, the fake engine and runner return fixed data, and each
scene waits for its workers before the picture is taken. After a deliberate
change, look at the report and update with `pytest --snapshot-update`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_tui_fakes import DUPLICATE_GPU_LINE, fake_app, multi_rank_log, paste_and_send, until

from assistant.tui.deps import MarkdownExporter
from assistant.tui.screens import CauseScreen, ExportChoice

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((120, 40), id="120x40")]


async def _settled(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: app.model_phase == "ready")
    await until(pilot, lambda: all(v.phase == "done" for v in app.turn_views))
    await pilot.pause()


async def _ask(pilot, text: str) -> None:
    await paste_and_send(pilot.app, pilot, text)
    await until(pilot, lambda: pilot.app.turn_views)
    await _settled(pilot)


@pytest.mark.parametrize("size", SIZES)
def test_welcome(snap_compare, size):
    async def scene(pilot):
        await _settled(pilot)

    assert snap_compare(fake_app(), terminal_size=size, run_before=scene)


@pytest.mark.parametrize("size", SIZES)
def test_answered_with_verdicts(snap_compare, size):
    async def scene(pilot):
        await _ask(pilot, multi_rank_log(200))

    assert snap_compare(fake_app(), terminal_size=size, run_before=scene)


@pytest.mark.parametrize("size", SIZES)
def test_cause_detail(snap_compare, size):
    async def scene(pilot):
        await _ask(pilot, DUPLICATE_GPU_LINE)
        view = pilot.app.turn_views[0]
        view.causes.focus()
        await pilot.press("down", "enter")  # set-device-order: an answer refuted here
        await until(pilot, lambda: isinstance(pilot.app.screen, CauseScreen))
        await until(pilot, lambda: pilot.app.screen.entry is not None)
        await pilot.pause()

    assert snap_compare(fake_app(), terminal_size=size, run_before=scene)


def test_chinese_interface(snap_compare):
    async def scene(pilot):
        await _ask(pilot, "我只有一张卡，DDP 一直报错找不到设备：" + DUPLICATE_GPU_LINE)

    assert snap_compare(fake_app(), terminal_size=(80, 24), run_before=scene)


class FixedHomeExporter(MarkdownExporter):
    """The real exporter with a home folder that is the same on every machine."""

    def home(self) -> Path:
        return Path("/home/you")


def test_export_to_an_unwritable_folder(snap_compare, monkeypatch):
    # The report's name carries the local time: the same zone everywhere.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()

    async def scene(pilot):
        await _ask(pilot, DUPLICATE_GPU_LINE)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(pilot.app.screen, ExportChoice))
        await pilot.pause()

    app = fake_app(export_dir=Path("/nonexistent/ddp-reports"), exporter=FixedHomeExporter())
    try:
        assert snap_compare(app, terminal_size=(80, 24), run_before=scene)
    finally:
        monkeypatch.undo()
        time.tzset()  # later tests see the machine's own zone again
