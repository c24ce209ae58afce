"""Pilot tests: the real chat app, driven by keys and pastes, with fake engine and runner."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_tui_fakes import (
    DUPLICATE_GPU_LINE,
    FIX_CODE,
    FakeEngine,
    FakeRunner,
    FixedClock,
    RecordedRunner,
    ask,
    done,
    fake_app,
    multi_rank_log,
    paste_and_send,
    run_command,
    screen_text,
    turns,
    until,
    widget_text,
)
from textual import events
from textual.widgets import Input

from assistant.chat.history import History
from assistant.pipeline import Pipeline
from assistant.probing.registry import probe_names
from assistant.tui.screens import CauseScreen, HistoryScreen, PathPrompt
from assistant.tui.turn import CauseItem, CauseList, TurnView
from assistant.tui.widgets import LARGE_PASTE_CHARS, ChatInput

pytestmark = pytest.mark.anyio


def cause_ids(view: TurnView) -> list[str]:
    return [c.id for c in view.turn.result.causes]


# -- input ----------------------------------------------------------------------------


async def test_paste_of_a_multi_rank_log_is_one_message_with_its_newlines():
    engine = FakeEngine()
    app = fake_app(engine=engine)
    log = multi_rank_log(500)
    async with app.run_test(size=(80, 24)) as pilot:
        app.post_message(events.Paste(log))
        await pilot.pause()
        assert app.query_one(ChatInput).text == log  # newlines kept, nothing sent yet
        assert turns(app) == []
        await pilot.press("enter")
        await until(pilot, done(app))
        assert [q for q, _, _ in engine.asked] == [log]
        assert len(turns(app)) == 1
        assert app.query_one(ChatInput).text == ""
        assert "[500 lines]" in screen_text(app)


async def test_enter_sends_and_the_newline_key_inserts_a_newline():
    engine = FakeEngine()
    app = fake_app(engine=engine)
    async with app.run_test() as pilot:
        await pilot.press("h", "i", "ctrl+j", "y", "o")
        assert app.query_one(ChatInput).text == "hi\nyo"
        await pilot.press("enter")
        await until(pilot, done(app))
        assert engine.asked[0][0] == "hi\nyo"
        footer = screen_text(app).splitlines()[-1]
        assert "Send" in footer and "Newline" in footer


@pytest.mark.parametrize("text", ["", "   \n\t  \n"])
async def test_an_empty_send_does_nothing_and_says_why(text):
    engine = FakeEngine()
    app = fake_app(engine=engine)
    async with app.run_test() as pilot:
        if text:
            app.post_message(events.Paste(text))
            await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert turns(app) == [] and engine.asked == []
        hint = app.query_one("#input-hint")
        assert "Nothing to send" in widget_text(hint)
        assert hint.has_class("-error")


async def test_a_10_mb_paste_is_accepted_and_answered():
    engine = FakeEngine()
    app = fake_app(engine=engine)
    line = f"[rank1]: {DUPLICATE_GPU_LINE}\n"
    text = line * (10_000_000 // len(line) + 1)
    assert len(text) > 10_000_000 > LARGE_PASTE_CHARS
    async with app.run_test(size=(80, 24)) as pilot:
        started = time.monotonic()
        app.post_message(events.Paste(text))
        await pilot.pause()
        chat_input = app.query_one(ChatInput)
        # The editor holds a token, not 10 MB, so the interface stays responsive.
        lines = f"{text.count(chr(10)):,} lines"
        assert len(chat_input.text) < 200 and f"{lines}, 10.0 MB" in chat_input.text
        assert chat_input.message_text == text
        await pilot.press("enter")
        await until(pilot, done(app))
        assert time.monotonic() - started < 30  # seconds, not minutes (figures: bench_speed)
        assert engine.asked[0][0] == text
        assert cause_ids(turns(app)[0])[0] == "duplicate-gpu-per-rank"


# -- answers and probes ---------------------------------------------------------------


async def test_causes_appear_then_probe_verdicts_rerank_them():
    runner = FakeRunner(hold=True)
    app = fake_app(runner=runner)
    async with app.run_test(size=(120, 40)) as pilot:
        await paste_and_send(app, pilot, multi_rank_log(50))
        await until(pilot, lambda: turns(app) and turns(app)[0].phase == "probing")
        view = turns(app)[0]
        # Retrieval order first, nothing judged yet.
        assert cause_ids(view) == [
            "set-device-order",
            "duplicate-gpu-per-rank",
            "master-endpoint-mismatch",
        ]
        assert all(c.verdict.verdict == "not_run" for c in view.turn.result.causes)
        assert "Root error" in screen_text(app)

        runner.release()
        await until(pilot, done(app))
        # Confirmed rises, ruled out sinks; evidence shows in the list.
        assert cause_ids(view)[0] == "duplicate-gpu-per-rank"
        verdicts = [c.verdict.verdict for c in view.turn.result.causes]
        assert verdicts == ["confirmed", "ruled_out", "ruled_out"]
        items = list(view.query(CauseItem))
        assert [i.cause.id for i in items] == cause_ids(view)
        text = screen_text(app)
        assert "tested on this machine: rank 0 and rank 1 both on GPU-3f2a" in text
        # One launch of every probe, started with the question (the pipeline's early launch).
        assert runner.calls == [probe_names()]


async def test_probe_progress_shows_which_probe_runs_and_for_how_long():
    runner = FakeRunner(hold=True)
    clock = FixedClock()
    app = fake_app(runner=runner, clock=clock)
    async with app.run_test(size=(120, 40)) as pilot:
        await paste_and_send(app, pilot, DUPLICATE_GPU_LINE)
        await until(pilot, lambda: turns(app) and turns(app)[0].running)
        view = turns(app)[0]
        first = probe_names()[0]
        clock.advance(2.5)
        # The elapsed-time timer ticks on its own schedule: wait for it, however loaded the machine.
        await until(pilot, lambda: f"{first} running 2.5s" in screen_text(app))
        assert view.probe_rows[first].state == "running"
        # Only what has started is counted: no made-up total.
        assert "0 probe(s) done, 1 running" in screen_text(app)
        runner.release()
        await until(pilot, done(app))
        assert all(r.state == "done" and r.status == "ok" for r in view.probe_rows.values())
        assert "devices ok 1.0s" in screen_text(app)


async def test_a_timed_out_probe_is_shown_as_such_and_the_app_keeps_going():
    runner = FakeRunner(outcomes={"devices": ("timeout", 60.0)})
    engine = FakeEngine()
    app = fake_app(runner=runner, engine=engine)
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert view.probe_rows["devices"].status == "timeout"
        duplicate = next(c for c in view.turn.result.causes if c.id == "duplicate-gpu-per-rank")
        assert duplicate.verdict.verdict == "inconclusive"
        assert "⧗ devices timed out 1m00s" in screen_text(app)
        second = await ask(app, pilot, "what if I use gloo?")
        assert second.phase == "done" and len(engine.asked) == 2


async def test_a_crashing_runner_is_reported_and_the_app_keeps_going():
    runner = FakeRunner(error=RuntimeError("torchrun not found"))
    engine = FakeEngine()
    app = fake_app(runner=runner, engine=engine)
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        status = widget_text(view.query_one(".turn-status"), width=300)
        assert "Probes failed: RuntimeError: torchrun not found" in status
        assert "No probe applies" not in status
        assert all(r.status == "error" for r in view.probe_rows.values())
        assert cause_ids(view)  # the causes are still there
        await ask(app, pilot, "still broken")
        assert len(engine.asked) == 2


async def test_window_is_usable_while_the_model_loads_and_queued_questions_are_answered():
    engine = FakeEngine(hold_load=True)
    app = fake_app(engine=engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "loading the model" in screen_text(app)
        await paste_and_send(app, pilot, DUPLICATE_GPU_LINE)
        await pilot.pause()
        view = turns(app)[0]
        assert view.phase == "waiting_model" and engine.asked == []
        assert "answered when it is ready" in widget_text(app.query_one("#input-hint"))
        engine.release()
        await until(pilot, done(app))
        assert len(engine.asked) == 1 and "model ready" in screen_text(app)


async def test_a_model_that_fails_to_load_is_shown_and_queued_questions_fail_cleanly():
    engine = FakeEngine(fail_load="no such model: bogus")
    app = fake_app(engine=engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.model_phase == "failed")
        assert "model failed: RuntimeError: no such model: bogus" in screen_text(app)


async def test_a_retrieval_error_marks_only_that_turn():
    engine = FakeEngine()
    app = fake_app(engine=engine)

    def broken_ask(query, top=5, context=None):
        raise OSError("index file is damaged")

    async with app.run_test(size=(100, 30)) as pilot:
        engine.ask = broken_ask
        await paste_and_send(app, pilot, "boom")
        await until(pilot, lambda: turns(app) and turns(app)[0].phase == "failed")
        assert "Failed: OSError: index file is damaged" in screen_text(app)


async def test_recorded_gpu_facts_confirm_the_cause_with_the_real_verdicts():
    runner = RecordedRunner("two_ranks_one_gpu")
    app = fake_app(runner=runner, pipeline_type=Pipeline)
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert runner.calls[0] == probe_names()
        duplicate = next(c for c in view.turn.result.causes if c.id == "duplicate-gpu-per-rank")
        assert (duplicate.verdict.verdict, duplicate.verdict.source) == ("confirmed", "probe")
        text = screen_text(app)
        assert "2 ranks on ws-lab-3 but only 1 visible GPU(s)" in text
        assert "✘ devices failed" in text and "✔ launch_env ok" in text


async def test_recorded_gpu_facts_mark_the_answers_this_machine_refutes():
    app = fake_app(runner=RecordedRunner("healthy_8gpu"), pipeline_type=Pipeline)
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        order = next(c for c in view.turn.result.causes if c.id == "set-device-order")
        assert "remove-set-device" in order.verdict.refutes
        view.causes.focus()
        view.causes.index = view.turn.result.causes.index(order)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, CauseScreen) and app.screen.entry)
        contradicting = widget_text(app.screen.query_one("#answers-contradicting"))
        # The community stance stays; the machine's outcome stands beside it.
        assert "[partly right]" in contradicting and "refuted on this machine #a4" in contradicting


# -- a cause in full -----------------------------------------------------------------


async def test_open_a_cause_see_both_sides_and_copy_the_fix():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        view.causes.focus()
        await pilot.press("down")  # the ruled-out set-device-order cause
        assert view.causes.highlighted_cause.id == "set-device-order"
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, CauseScreen) and app.screen.entry)
        screen = app.screen
        text = screen_text(app)
        assert "ruled out · tested on this machine" in text
        assert "NCCL binds its communicator to the current CUDA device" in text  # why
        agreeing = widget_text(screen.query_one("#answers-agreeing"))
        contradicting = widget_text(screen.query_one("#answers-contradicting"))
        assert "#a8" in agreeing and "#a7" in contradicting
        assert "[partly right]" in contradicting  # the community's word ...
        assert "refuted on this machine" in contradicting  # ... and this machine's
        references = widget_text(screen.query_one("#detail-bottom"))
        assert "References" in references and "DDP tutorial" in references
        await pilot.press("c")
        assert app.last_copied == FIX_CODE.strip()
        assert app.clipboard == FIX_CODE.strip()
        await pilot.press("escape")
        assert not isinstance(app.screen, CauseScreen)


async def test_copy_the_fix_straight_from_the_list():
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, "first question")
        view = await ask(app, pilot, "master port mismatch")
        await pilot.press("tab")  # from the input to the newest causes
        assert view.causes.has_focus
        await pilot.press("down", "down", "c")
        assert view.causes.highlighted_cause.id == "master-endpoint-mismatch"
        assert app.last_copied == "# remove os.environ['MASTER_PORT'] = ... from the script"
        await pilot.press("escape")
        assert app.query_one(ChatInput).has_focus


async def test_a_cause_whose_entry_cannot_be_read_still_opens():
    engine = FakeEngine()
    app = fake_app(engine=engine)

    def broken_cause(cause_id):
        raise OSError("index closed")

    async with app.run_test(size=(100, 30)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        engine.cause = broken_cause
        view.causes.focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, CauseScreen) and app.screen.entry_error)
        assert "full entry is not available" in screen_text(app)
        await pilot.press("c")
        assert app.last_copied == FIX_CODE.strip()


# -- follow-ups and language ------------------------------------------------------------


async def test_a_follow_up_carries_the_root_error_and_confirmed_causes():
    engine = FakeEngine()
    runner = FakeRunner()
    app = fake_app(engine=engine, runner=runner)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, multi_rank_log(40))
        follow = await ask(app, pilot, "what if I use gloo?")
        query, _, context = engine.asked[1]
        assert query == "what if I use gloo?"
        assert engine.asked[0][2] is None  # the first question has no context
        assert "DistBackendError" in context and "Duplicate GPU detected" in context
        assert "duplicate-gpu-per-rank" in context
        # Probes already measured in this conversation are reused, not rerun.
        assert len(runner.calls) == 1
        assert follow.probe_rows["devices"].reused


async def test_the_interface_follows_the_language_of_the_question_and_the_binding_switches_it():
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, "我只有一张卡，DDP 一直报错找不到设备")
        assert app.lang == "zh"
        text = screen_text(app)
        assert "模型已就绪" in text and "多个进程（rank）落在同一张物理 GPU 上" in text
        assert "发送" in text.splitlines()[-1]  # footer follows too
        # A pasted English log does not flip a Chinese interface back.
        await ask(app, pilot, multi_rank_log(20))
        assert app.lang == "zh"
        await pilot.press("ctrl+l")
        assert app.lang == "en"
        text = screen_text(app)
        assert "model ready" in text and "Send" in text.splitlines()[-1]
        # English prose switches to English; the binding goes back to Chinese.
        await pilot.press("ctrl+l")
        assert app.lang == "zh"
        await ask(app, pilot, "what if I use gloo instead?")
        assert app.lang == "en"


# -- command palette ----------------------------------------------------------------------


async def test_palette_runs_doctor():
    runner = FakeRunner()
    app = fake_app(runner=runner)
    async with app.run_test(size=(100, 30)) as pilot:
        await run_command(app, pilot, "doctor")
        await until(pilot, done(app))
        view = turns(app)[0]
        assert view.turn.kind == "doctor"
        assert runner.calls == [["launch_env", "devices", "backend", "versions"]]
        assert turns(app)[0].lang == "en"
        assert view.turn.result.causes[0].verdict.verdict == "confirmed"
        assert "doctor: check this machine" in screen_text(app)


async def test_doctor_with_the_real_pipeline_on_a_recorded_gpu_machine():
    runner = RecordedRunner("more_procs_than_gpus")
    app = fake_app(runner=runner, pipeline_type=Pipeline)
    async with app.run_test(size=(120, 40)) as pilot:
        await run_command(app, pilot, "doctor")
        await until(pilot, done(app))
        view = turns(app)[0]
        assert len(runner.calls) == 1 and "devices" in runner.calls[0]
        verdicts = [c.verdict.verdict for c in view.turn.result.causes]
        assert verdicts[0] == "confirmed" and verdicts == sorted(
            verdicts, key=lambda v: {"confirmed": 0, "ruled_out": 2}.get(v, 1)
        )
        assert "✘ devices failed" in screen_text(app)


async def test_palette_lints_a_script_and_the_findings_feed_the_verdicts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import argparse\nparser.add_argument('--local_rank', default=0)\n")
    runner = FakeRunner(outcomes={"devices": ("timeout", 60.0)})
    app = fake_app(runner=runner)
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, "DDP can't find the device")
        before = next(c for c in view.turn.result.causes if c.id == "duplicate-gpu-per-rank")
        assert before.verdict.verdict == "inconclusive"

        await run_command(app, pilot, "lint a training")
        assert isinstance(app.screen, PathPrompt)
        await pilot.press("enter")  # empty path: says why, stays open
        assert isinstance(app.screen, PathPrompt)
        assert "Type a path first" in widget_text(app.screen.query_one("#prompt-error"))
        app.screen.query_one(Input).value = str(script)
        await pilot.press("enter")
        await until(pilot, done(app, 2))
        lint = turns(app)[1]
        assert lint.turn.kind == "lint" and len(lint.turn.findings) == 1
        assert "1 finding(s)" in screen_text(app)
        after = next(c for c in view.turn.result.causes if c.id == "duplicate-gpu-per-rank")
        assert any("local_rank defaults to 0" in line for line in after.verdict.evidence)


async def test_linting_a_missing_file_says_so_in_one_line(tmp_path, monkeypatch):
    # A path relative to the working folder: a long temporary path (pytest-xdist's
    # are) would wrap the one line on a 100-column screen.
    monkeypatch.chdir(tmp_path)
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        app.action_lint()
        await pilot.pause()
        app.screen.query_one(Input).value = "nope.py"
        await pilot.press("enter")
        await until(pilot, done(app))
        assert turns(app)[0].phase == "failed"
        # the phase is set before the next refresh draws the message
        await until(pilot, lambda: "nope.py: no such file" in screen_text(app))


async def test_palette_rebuilds_the_knowledge_base():
    engine = FakeEngine()
    app = fake_app(engine=engine)
    notes: list[str] = []
    async with app.run_test(size=(100, 30)) as pilot:
        app.notify = lambda message, **kw: notes.append(str(message))
        await run_command(app, pilot, "rebuild")
        await until(pilot, lambda: engine.rebuilds == 1 and notes)
        assert notes == ["Knowledge base rebuilt: 3 causes, 1 thread, 12 vectors"]


async def test_export_writes_markdown_ready_for_an_issue(tmp_path):
    app = fake_app(export_dir=tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        app.action_export()  # nothing yet
        assert app.last_export is None
        await ask(app, pilot, multi_rank_log(30))
        await run_command(app, pilot, "export")
        assert app.last_export is not None and app.last_export.parent == tmp_path
        text = app.last_export.read_text(encoding="utf-8")
        assert text == app.last_copied
        assert "## Root error (rank 1)" in text and "Duplicate GPU detected" in text
        assert "| 1 | Two or more ranks are on the same physical GPU" in text
        assert "rank 0 and rank 1 both on GPU-3f2a" in text  # evidence
        assert "```python\n" + FIX_CODE.rstrip() + "\n```" in text
        assert "uuid: GPU-3f2a" in text  # environment facts from the probes


# -- history ------------------------------------------------------------------------------


async def test_history_is_kept_reopened_and_deleted(tmp_path):
    history = History(tmp_path / "history.sqlite")
    app = fake_app(history=history)
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, multi_rank_log(30))
        await ask(app, pilot, "what if I use gloo?")
        saved = history.list()
        assert len(saved) == 1 and saved[0].turns == 2
        first_id = saved[0].id

        await app.action_new_conversation()
        assert turns(app) == []
        await ask(app, pilot, "another problem")
        assert len(history.list()) == 2

        await pilot.press("ctrl+r")
        assert isinstance(app.screen, HistoryScreen)
        assert "2 turn(s)" in screen_text(app) and "DistBackendError" in screen_text(app)
        await pilot.press("down", "enter")  # the older conversation
        await until(pilot, lambda: not isinstance(app.screen, HistoryScreen))
        assert app.conversation.id == first_id and len(turns(app)) == 2
        restored = turns(app)[0]
        assert cause_ids(restored)[0] == "duplicate-gpu-per-rank"
        assert restored.probe_rows["devices"].status == "ok"
        assert "tested on this machine: rank 0 and rank 1 both on GPU-3f2a" in screen_text(app)

        await pilot.press("ctrl+r")
        await pilot.press("d")  # asks first: nothing is lost on one keystroke
        await pilot.pause()
        assert len(history.list()) == 2
        assert any("Press d again" in notice for notice in app.notices)
        await pilot.press("down", "d")  # moving on cancels; this one asks again
        await pilot.pause()
        assert len(history.list()) == 2
        await pilot.press("d")
        await pilot.pause()
        assert len(history.list()) == 1
        await pilot.press("d", "d")
        await pilot.pause()
        assert history.list() == []
        assert "No saved conversation yet" in screen_text(app)


async def test_a_broken_history_file_does_not_stop_the_chat(tmp_path):
    bad = tmp_path / "history.sqlite"
    bad.write_text("this is not a database")
    app = fake_app(history=History(bad))
    async with app.run_test(size=(100, 30)) as pilot:
        await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert "cannot open the chat history" in app.history_error
        await ask(app, pilot, "and now?")
        assert len(turns(app)) == 2


def test_quitting_while_the_model_loads_exits_at_once():
    """A model load cannot be interrupted; the process must not wait for it at exit."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_tui_fakes import FakeEngine, fake_app

        app = fake_app(engine=FakeEngine(hold_load=True))  # load() blocks for 30 s

        async def quit_while_loading(pilot):
            await pilot.pause(0.5)
            assert app.engine_busy
            await pilot.press("ctrl+q")

        app.run(headless=True, auto_pilot=quit_while_loading)
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 40  # did not wait for the model load to finish


# -- quitting and layout -----------------------------------------------------------------


async def test_quitting_while_probes_run_stops_them():
    runner = FakeRunner(hold=True)
    app = fake_app(runner=runner)
    async with app.run_test(size=(80, 24)) as pilot:
        await paste_and_send(app, pilot, DUPLICATE_GPU_LINE)
        await until(pilot, lambda: runner.started.is_set())
        assert app.probes_running
        await pilot.press("ctrl+q")
    assert runner.cancelled.is_set() and runner.returned.is_set()
    assert not app.probes_running


async def test_layout_fits_80x24_and_grows():
    for size in ((80, 24), (160, 50)):
        app = fake_app()
        async with app.run_test(size=size) as pilot:
            await ask(app, pilot, multi_rank_log(100))
            width, height = size
            for selector in ("#status", "#chat-input", "Footer"):
                region = app.query_one(selector).region
                assert region.right <= width and region.bottom <= height and region.height > 0
            conversation = app.query_one("#conversation").region
            assert conversation.height >= height - 9
            assert app.query_one(CauseList).region.width > width - 10
