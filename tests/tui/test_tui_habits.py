"""A person's habits, from the tester's findings: each one driven through the real app."""

from __future__ import annotations

import pytest
from test_tui_fakes import (
    DUPLICATE_GPU_LINE,
    ask,
    fake_app,
    paste_and_send,
    run_command,
    screen_text,
    turns,
    until,
    widget_text,
)
from textual import events
from textual.widgets import Input, OptionList

from assistant.chat.history import History
from assistant.tui.screens import ExportChoice, HistoryScreen, PathPrompt
from assistant.tui.widgets import LARGE_PASTE_CHARS, ChatInput

pytestmark = pytest.mark.anyio


async def test_text_typed_while_the_causes_have_focus_goes_to_the_input():
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        view.causes.focus()
        await pilot.press("w", "h", "y", "space", "n", "o", "t")
        chat_input = app.query_one(ChatInput)
        assert chat_input.has_focus and chat_input.text == "why not"
        # The list's own keys still work there.
        view.causes.focus()
        await pilot.press("c")
        assert app.last_copied and chat_input.text == "why not"


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
async def test_a_5700_line_paste_is_labelled_with_its_real_line_count(newline):
    line = f"[rank1]: step loss 0.1234 {DUPLICATE_GPU_LINE[:20]}"
    text = newline.join([line] * 5700)
    assert len(text) > LARGE_PASTE_CHARS
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        app.post_message(events.Paste(text))
        await pilot.pause()
        assert "5,700 lines" in app.query_one(ChatInput).text


async def test_a_huge_one_line_paste_says_one_line():
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        app.post_message(events.Paste("x" * (LARGE_PASTE_CHARS + 1)))
        await pilot.pause()
        assert "one line, 200 KB" in app.query_one(ChatInput).text


async def test_the_chinese_palette_finds_a_command_by_its_english_name():
    app = fake_app(lang="zh")
    async with app.run_test(size=(100, 30)) as pilot:
        await run_command(app, pilot, "doctor")
        await until(pilot, lambda: turns(app) and turns(app)[0].phase == "done")
        assert turns(app)[0].turn.kind == "doctor"
    app = fake_app(lang="zh")
    async with app.run_test(size=(100, 30)) as pilot:
        await run_command(app, pilot, "体检")  # and by its Chinese one
        await until(pilot, lambda: turns(app) and turns(app)[0].phase == "done")


async def test_a_chinese_chat_reopened_in_the_english_interface_stays_chinese(tmp_path):
    history = History(tmp_path / "history.sqlite")
    app = fake_app(history=history)
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(app, pilot, "我只有一张卡，DDP 一直报错找不到设备")
    app = fake_app(history=History(tmp_path / "history.sqlite"), lang="en")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+r")
        assert isinstance(app.screen, HistoryScreen)
        await pilot.press("enter")
        await until(pilot, lambda: not isinstance(app.screen, HistoryScreen) and turns(app))
        assert app.lang == "en"
        view = turns(app)[0]
        text = widget_text(view.query_one(".turn-status"), width=300)
        titles = " ".join(widget_text(label) for label in view.query(".cause-title"))
        verdicts = " ".join(widget_text(label) for label in view.query(".cause-verdict"))
        # The turn speaks one language: its own.
        assert "多个进程（rank）落在同一张物理 GPU 上" in titles
        assert "Two or more ranks" not in titles
        assert "已确认" in verdicts and "confirmed" not in verdicts
        assert "确认 1 个" in text and "confirmed," not in text
        assert "model ready" in screen_text(app)  # the interface itself stays English


async def test_an_export_to_an_unwritable_folder_offers_home_other_path_or_clipboard(
    tmp_path, monkeypatch
):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    gone = tmp_path / "no-such-folder"
    app = fake_app(export_dir=gone)
    async with app.run_test(size=(120, 40)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, ExportChoice))
        reason = widget_text(app.screen.query_one("#export-reason"), width=300).strip()
        assert reason.startswith(f"Cannot write the report to {gone}/ddp-assistant-")
        assert "No such file or directory" in reason and "\n" not in reason
        options = app.screen.query_one(OptionList)
        assert options.option_count == 3

        # 1. the home folder
        await pilot.press("enter")
        await until(pilot, lambda: app.last_export is not None)
        assert app.last_export.parent == home and app.last_export.is_file()

        # 2. another path, typed
        app.last_export = None
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, ExportChoice))
        await pilot.press("down", "enter")
        await until(pilot, lambda: isinstance(app.screen, PathPrompt))
        target = tmp_path / "reports" / "crash.md"
        target.parent.mkdir()
        app.screen.query_one(Input).value = str(target)
        await pilot.press("enter")
        await until(pilot, lambda: app.last_export == target)
        assert "# DDP assistant report" in target.read_text(encoding="utf-8")

        # 3. the clipboard only
        app.last_copied = None
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, ExportChoice))
        await pilot.press("down", "down", "enter")
        await until(pilot, lambda: app.last_copied is not None)
        assert app.clipboard.startswith("# DDP assistant report")
        assert "copied to the clipboard (not saved" in app.notices[-1]


async def test_a_new_question_stops_the_probes_of_the_one_still_running():
    from test_tui_fakes import FakeRunner

    runner = FakeRunner(hold=True)
    app = fake_app(runner=runner)
    async with app.run_test(size=(100, 30)) as pilot:
        await paste_and_send(app, pilot, DUPLICATE_GPU_LINE)
        await until(pilot, lambda: runner.started.is_set())
        await paste_and_send(app, pilot, "never mind, what about gloo?")
        await until(pilot, lambda: runner.cancelled.is_set())
        runner.release()
        await until(pilot, lambda: len(turns(app)) == 2 and turns(app)[1].phase == "done")
        first, second = turns(app)
        assert any(row.status == "interrupted" for row in first.probe_rows.values())
        assert "nccl-with-cpu-tensors" in [c.id for c in second.turn.result.causes]
        # The second question ran its own probes: interrupted runs are never reused.
        assert all(row.status == "ok" for row in second.probe_rows.values())
