"""The chat's "Run a launch command" and the feedback keys (f / w on a cause)."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest
from test_tui_fakes import (
    DUPLICATE_GPU_LINE,
    ask,
    fake_app,
    run_command,
    sample_causes,
    screen_text,
    until,
    widget_text,
)
from textual.widgets import Input, Static

from assistant.feedback import FeedbackStore
from assistant.results import Result, RootError
from assistant.tui.present import OUTPUT_LINES, OutputTail
from assistant.tui.run_actions import split_command
from assistant.tui.screens import PathPrompt
from assistant.tui.turn import CauseList
from assistant.watch import RunCallbacks, RunOutcome
from assistant.watch.jobhook import WATCH_DIR_VAR
from assistant.watch.stacks import Frame
from assistant.watch.watcher import LaunchReport, RankReport

pytestmark = pytest.mark.anyio


def failed_launch(command: list[str]) -> LaunchReport:
    """What the watcher reports for a 2-rank job whose rank 1 raised."""
    ranks = [
        RankReport(0, "node-a", 101, -15, None, Frame("/w/train.py", 30, "main"), "barrier"),
        RankReport(
            1,
            "node-a",
            102,
            1,
            {"type": "ValueError", "message": "bad batch shape on rank one"},
            Frame("/w/train.py", 12, "main"),
        ),
    ]
    return LaunchReport(
        command, 1, False, Path("/tmp/logs"), ranks, RootError("ValueError", "bad batch", 1)
    )


class FakeLauncher:
    """deps.launcher with the real signature: streams output, reports the launch, answers.

    hold=True keeps the job "running" until its cancel event is set (as the
    real watcher does when the person quits or starts another run).
    """

    def __init__(self, lines: int = 3, hold: bool = False):
        self.lines = lines
        self.hold = hold
        self.cancels: list[threading.Event] = []

    def run(self, command: list[str], callbacks: RunCallbacks, cancel: threading.Event):
        self.cancels.append(cancel)
        for number in range(self.lines):
            callbacks.on_output("stdout", f"step {number}\n".encode())
        if self.hold:
            cancel.wait(30)
            launch = failed_launch(command)
            launch.cancelled = True
            callbacks.on_launch(launch)
            return RunOutcome(launch, None)
        launch = failed_launch(command)
        callbacks.on_launch(launch)
        result = Result(
            query="ValueError: bad batch", root_error=launch.root_error, causes=sample_causes()
        )
        return RunOutcome(launch, result)


async def start_run(app, pilot, line: str) -> None:
    await run_command(app, pilot, "run a launch")
    await until(pilot, lambda: isinstance(app.screen, PathPrompt))
    app.screen.query_one(Input).value = line
    await pilot.press("enter")
    await until(pilot, lambda: not isinstance(app.screen, PathPrompt))


def part(view, name: str) -> str:
    return widget_text(view.query_one(f".turn-{name}", Static))


def test_split_command_never_needs_a_shell():
    assert split_command("torchrun --nproc_per_node=2 'my train.py' --lr 1e-3") == [
        "torchrun",
        "--nproc_per_node=2",
        "my train.py",
        "--lr",
        "1e-3",
    ]
    with pytest.raises(Exception, match="cannot read the command"):
        split_command("python 'unclosed")


def test_the_output_tail_is_bounded_and_joins_split_lines():
    tail = OutputTail(limit=3)
    for number in range(1000):
        tail.feed(f"line {number}\n".encode())
    tail.feed(b"half a ")
    tail.feed(b"line\r\n\x1b[31mred\x1b[0m\n")
    assert tail.shown() == ["line 999", "half a line", "red"] and tail.total == 1002


def test_a_rank_line_says_who_failed_and_where():
    line = failed_launch(["x"]).ranks[1].summary()
    assert line == (
        "rank 1 (node-a, exit 1): ValueError: bad batch shape on rank one at /w/train.py:12 in main"
    )
    assert "waits in barrier at /w/train.py:30" in failed_launch(["x"]).ranks[0].summary()


async def test_a_run_streams_its_output_then_answers_with_the_ranks(tmp_path):
    answers = FeedbackStore(tmp_path / "feedback.sqlite")
    launcher = FakeLauncher(lines=40)
    app = fake_app(launcher=launcher, answers=answers)
    async with app.run_test(size=(110, 40)) as pilot:
        await start_run(app, pilot, "torchrun --nproc_per_node=2 'train.py'")
        view = app.turn_views[-1]
        await until(pilot, lambda: view.phase == "done")
        output = part(view, "output")
        # Only the tail of the output is kept on screen.
        assert "step 39" in output and "step 0\n" not in output
        ranks = part(view, "ranks")
        assert "rank 1 (node-a, exit 1): ValueError: bad batch shape" in ranks
        assert "at /w/train.py:12 in main" in ranks and "waits in barrier" in ranks
        assert view.turn.query == "$ torchrun --nproc_per_node=2 train.py"
        assert [c.id for c in view.turn.result.causes][:2] == [
            "set-device-order",
            "duplicate-gpu-per-rank",
        ]
        # The run's answer is kept like a question's, so its causes take feedback.
        assert len(view.turn.result.answer_id) == 12
    assert launcher.cancels and not launcher.cancels[0].is_set()


async def test_a_new_run_or_quitting_stops_the_running_job():
    launcher = FakeLauncher(hold=True)
    app = fake_app(launcher=launcher)
    async with app.run_test(size=(110, 40)) as pilot:
        await start_run(app, pilot, "python train.py")
        first = app.turn_views[-1]
        await until(pilot, lambda: first.phase == "job" and "step 2" in part(first, "output"))
        assert "The job is running" in widget_text(first.query_one(".turn-status", Static))
        await start_run(app, pilot, "python train.py --again")
        await until(pilot, lambda: first.phase == "done")
        assert launcher.cancels[0].is_set()
        assert "The job was stopped" in widget_text(first.query_one(".turn-status", Static))
        await pilot.press("ctrl+q")
    assert len(launcher.cancels) == 2 and launcher.cancels[1].is_set()


async def test_a_command_that_cannot_be_read_is_one_line():
    app = fake_app(launcher=FakeLauncher())
    async with app.run_test(size=(110, 40)) as pilot:
        await start_run(app, pilot, "python 'unclosed")
        await pilot.pause()
        assert app.turn_views == [] and "cannot read the command" in app.notices[-1]


async def test_a_real_failing_command_shows_its_output_and_its_answer():
    command = [
        sys.executable,
        "-c",
        "print('hello from the job', flush=True); raise ValueError('boom in the job')",
    ]
    app = fake_app(run_probe=False)
    async with app.run_test(size=(110, 40)) as pilot:
        await until(pilot, lambda: app.model_phase == "ready")
        await run_command(app, pilot, "run a launch")
        await until(pilot, lambda: isinstance(app.screen, PathPrompt))
        app.screen.query_one(Input).value = shlex.join(command)
        await pilot.press("enter")
        await until(pilot, lambda: bool(app.turn_views))
        view = app.turn_views[-1]
        await until(pilot, lambda: view.phase in ("done", "failed"), timeout=120)
        assert view.phase == "done", view.error
        assert "hello from the job" in part(view, "output")
        assert "ValueError: boom in the job" in part(view, "ranks")
        assert view.turn.result is not None and view.turn.result.causes
        assert view.turn.root_error.type == "ValueError"
        assert app.runs.count == 0


def job_pids(log_dir: str) -> list[int]:
    """Processes still running with the watched job's environment (the watcher marks it)."""
    from assistant.probing.processes import pids_with_env

    return [pid for pid in pids_with_env(WATCH_DIR_VAR, str(Path(log_dir).resolve())) if alive(pid)]


async def test_a_real_two_rank_torchrun_names_the_rank_that_failed():
    script = Path(__file__).resolve().parent.parent / "data" / "scripts" / "raises_on_rank_one.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)]
    app = fake_app(run_probe=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await start_run(app, pilot, shlex.join(command))
        view = app.turn_views[-1]
        await until(pilot, lambda: view.phase in ("done", "failed"), timeout=240)
        assert view.phase == "done", view.error
        # torchrun's failure banner is longer than the kept tail: only its end shows.
        assert view.job.output.total > len(view.job.output.shown()) == OUTPUT_LINES
        assert "elastic" in part(view, "output")
        ranks = part(view, "ranks")
        assert "rank 1 (" in ranks and "ValueError: bad batch shape on rank one" in ranks
        assert "raises_on_rank_one.py:" in ranks  # where rank 1 raised
        assert view.turn.root_error.rank == 1 and view.turn.result.causes
        log_dir = ranks.split("logs: ")[1].split()[0]
    assert job_pids(log_dir) == []


async def test_quitting_ends_a_real_job_and_leaves_no_process():
    command = [
        sys.executable,
        "-c",
        "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)",
    ]
    app = fake_app(run_probe=False)
    async with app.run_test(size=(110, 40)) as pilot:
        await start_run(app, pilot, shlex.join(command))
        view = app.turn_views[-1]
        await until(pilot, lambda: "pid " in part(view, "output"), timeout=60)
        pid = int(part(view, "output").split("pid ")[1].split()[0])
        await pilot.press("ctrl+q")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(pid):
        await asyncio.sleep(0.1)
    assert not alive(pid)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its parent's wait() is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# -- feedback ----------------------------------------------------------------------------


async def answered_with_causes_focused(app, pilot):
    view = await ask(app, pilot, DUPLICATE_GPU_LINE)
    await pilot.press("tab")
    assert isinstance(app.focused, CauseList)
    return view


@pytest.mark.parametrize(("key", "verdict"), [("f", "fixed"), ("w", "wrong")])
async def test_a_cause_key_records_feedback_in_the_answers_log(tmp_path, key, verdict):
    answers = FeedbackStore(tmp_path / "feedback.sqlite")
    app = fake_app(answers=answers)
    async with app.run_test(size=(110, 40)) as pilot:
        view = await answered_with_causes_focused(app, pilot)
        handle = view.turn.result.answer_id
        first = view.turn.result.causes[0].id
        assert handle
        await pilot.press(key)  # once: asks to press again, records nothing
        await pilot.pause()
        assert f"Press {key} again" in app.notices[-1] and answers.summary() == []
        await pilot.press(key)
        await until(pilot, lambda: bool(answers.summary()))
        await until(pilot, lambda: handle in app.notices[-1])
    [row] = answers.summary()
    assert row.cause_id == first
    assert (row.fixed, row.wrong) == ((1, 0) if verdict == "fixed" else (0, 1))
    assert first in app.notices[-1]


async def test_a_follow_up_is_kept_as_a_reply_so_ask_after_reads_the_whole_chat(tmp_path):
    answers = FeedbackStore(tmp_path / "feedback.sqlite")
    app = fake_app(answers=answers)
    async with app.run_test(size=(110, 40)) as pilot:
        first = await ask(app, pilot, DUPLICATE_GPU_LINE)
        reply = await ask(app, pilot, "nvidia-smi shows both ranks on GPU 0")
    assert first.turn.result.answer_id and reply.turn.result.answer_id
    assert answers.thread_of(reply.turn.result.answer_id) == [
        DUPLICATE_GPU_LINE,
        "nvidia-smi shows both ranks on GPU 0",
    ]


def footer_words(app, lang: str) -> set[str]:
    """The descriptions the footer may show for the focused list in `lang`."""
    return {
        active.binding.description
        for active in app.active_bindings.values()
        if active.binding.show and active.binding.action.startswith(f"in_lang({lang!r}")
    }


async def test_the_feedback_keys_are_in_the_footer_in_both_languages(tmp_path):
    app = fake_app(answers=FeedbackStore(tmp_path / "feedback.sqlite"))
    async with app.run_test(size=(160, 40)) as pilot:
        await answered_with_causes_focused(app, pilot)
        assert {"Fixed it", "Wrong cause"} <= footer_words(app, "en")
        assert "Fixed it" in screen_text(app)
        app.lang = "zh"
        await pilot.pause()
        assert {"已解决", "原因不对"} <= footer_words(app, "zh")


async def test_a_word_typed_into_the_list_leaves_no_feedback(tmp_path):
    answers = FeedbackStore(tmp_path / "feedback.sqlite")
    app = fake_app(answers=answers)
    async with app.run_test(size=(110, 40)) as pilot:
        await answered_with_causes_focused(app, pilot)
        await pilot.press("w", "h", "y")
        await pilot.pause()
    assert answers.summary() == []


async def test_with_history_off_answers_have_no_id_and_the_keys_type_into_the_input(tmp_path):
    app = fake_app(history_off=True)  # as run_chat builds it: no answers store
    async with app.run_test(size=(110, 40)) as pilot:
        view = await answered_with_causes_focused(app, pilot)
        assert view.turn.result.answer_id == "" and app.deps.answers is None
        assert "Fixed it" not in footer_words(app, "en")
        await pilot.press("f", "w")
        await pilot.pause()
        assert app.chat_input.text == "fw" and not app.notices
    assert list(tmp_path.iterdir()) == []


async def test_a_command_that_cannot_start_fails_its_turn_in_one_line():
    app = fake_app(run_probe=False)
    async with app.run_test(size=(110, 40)) as pilot:
        await start_run(app, pilot, "no-such-launcher-anywhere --nproc_per_node=2 train.py")
        view = app.turn_views[-1]
        await until(pilot, lambda: view.phase in ("done", "failed"), timeout=60)
        assert view.phase == "failed" and "\n" not in view.error
        assert "no-such-launcher-anywhere" in view.error and "Traceback" not in view.error
        assert app.runs.count == 0


class PruningLauncher(FakeLauncher):
    """A launcher whose run starts as the real one does: with what pruning old logs did."""

    def __init__(self, problem: str | None):
        super().__init__()
        self.problem = problem

    def run(self, command: list[str], callbacks: RunCallbacks, cancel: threading.Event):
        from assistant.watch import RunStart
        from assistant.watch.retention import Pruned

        pruned = Pruned(removed=[Path("/tmp/old-run")], problem=self.problem)
        callbacks.on_start(RunStart(Path("/tmp/logs"), pruned))
        return super().run(command, callbacks, cancel)


@pytest.mark.parametrize(
    "problem", [None, "old run logs were not pruned: ASSISTANT_RUNS_KEEP must be a whole number"]
)
async def test_a_pruning_problem_is_one_notice_and_the_run_goes_on(problem):
    app = fake_app(launcher=PruningLauncher(problem))
    async with app.run_test(size=(110, 40)) as pilot:
        await start_run(app, pilot, "torchrun --nproc_per_node=2 train.py")
        view = app.turn_views[-1]
        await until(pilot, lambda: view.phase == "done")
        assert app.notices == ([problem] if problem else [])
        assert view.turn.result is not None  # the run was answered all the same
