"""Say only what is true: where each verdict comes from, stances beside outcomes, confidence.

Pilot tests on the real app and pipeline with the fakes of test_tui_fakes.
"""

from __future__ import annotations

import pytest
from test_tui_fakes import (
    DUPLICATE_GPU_LINE,
    SURE_MARK,
    TablePipeline,
    ask,
    fake_app,
    run_command,
    screen_text,
    until,
    widget_text,
)
from textual.widgets import Input

from assistant.results import Verdict
from assistant.tui.screens import CauseScreen, PathPrompt

pytestmark = pytest.mark.anyio


def verdict_column(view) -> list[str]:
    return [widget_text(label).strip() for label in view.query(".cause-verdict")]


def detail_lines(view) -> list[str]:
    return [widget_text(label, width=300).strip() for label in view.query(".cause-detail")]


class ErrorSaysSo(TablePipeline):
    """Judges the first cause from the error text alone (verdict source "error")."""

    def judge(self, result, runs, findings=(), script_checked=False):
        judged = super().judge(result, runs, findings, script_checked)
        judged.causes[0].verdict = Verdict("confirmed", ["the error names it"], source="error")
        return judged


async def test_a_probe_verdict_says_tested_on_this_machine():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert verdict_column(view)[:2] == ["confirmed  0.74", "ruled out  0.81"]
        details = detail_lines(view)
        assert details[0] == "tested on this machine: rank 0 and rank 1 both on GPU-3f2a"
        assert details[1].startswith("tested on this machine: set_device before")


async def test_an_error_verdict_says_the_error_says_so_and_never_tested_here():
    app = fake_app(pipeline_type=ErrorSaysSo)
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        assert verdict_column(view)[0].startswith("confirmed")
        first = detail_lines(view)[0]
        assert first == "the error says so: the error names it"
        assert "machine" not in first and "here" not in first


async def test_a_script_verdict_names_the_line_of_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import argparse\nparser.add_argument('--local_rank', default=0)\n")
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, "DDP can't find the device on my 2 GPUs")
        await run_command(app, pilot, "lint a training")
        assert isinstance(app.screen, PathPrompt)
        app.screen.query_one(Input).value = str(script)
        await pilot.press("enter")
        await until(
            pilot,
            lambda: any("your script, line 2" in line for line in detail_lines(view)),
        )
        assert "your script, line 2: " in " ".join(detail_lines(view))
        scripted = next(c for c in view.turn.result.causes if c.verdict.source == "script")
        assert scripted.verdict.verdict == "confirmed"


async def test_a_stance_shows_its_question_and_the_machine_outcome_beside_it():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, DUPLICATE_GPU_LINE)
        view.causes.focus()
        view.causes.index = [c.id for c in view.turn.result.causes].index("set-device-order")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, CauseScreen) and app.screen.entry)
        contradicting = widget_text(app.screen.query_one("#answers-contradicting"), width=300)
        # The community said "partly right" about ITS question; this machine refuted the advice.
        assert "✘ [partly right] · refuted on this machine #a7\non “DDP 一直报错找不到设备" in (
            contradicting
        )
        assert "init_pro…”" in contradicting  # the question, shortened
        agreeing = widget_text(app.screen.query_one("#answers-agreeing"), width=300)
        assert "[right] #a8\non “DDP 一直报错找不到设备" in agreeing  # nothing shown here about a8


async def test_a_sure_answer_says_high_confidence_and_asks_nothing():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, f"{SURE_MARK} {DUPLICATE_GPU_LINE}")
        assert view.turn.result.confidence == "high"
        assert "confidence: high" in widget_text(view.query_one(".turn-status"), width=300)
        assert not view.query_one(".turn-decide").display
        assert "To tell these apart" not in screen_text(app)


async def test_an_unsure_answer_asks_one_question_and_the_reply_is_a_follow_up():
    engine_app = fake_app()
    async with engine_app.run_test(size=(120, 40)) as pilot:
        app = engine_app
        view = await ask(app, pilot, "DDP keeps saying it can't find the device")
        result = view.turn.result
        assert result.confidence in ("medium", "low") and result.decide
        assert f"confidence: {result.confidence}" in widget_text(
            view.query_one(".turn-status"), width=300
        )
        decide = widget_text(view.query_one(".turn-decide"), width=400).strip()
        assert decide.startswith("? To tell these apart, paste: ")
        assert decide.count("?") == 1  # one short question, not a questionnaire
        assert result.decide[0] in decide

        await ask(app, pilot, "nvidia-smi shows both processes on GPU 0")
        engine = app.deps.knowledge.engine
        query, _, context = engine.asked[-1]
        assert query == "nvidia-smi shows both processes on GPU 0"
        assert "Earlier question: DDP keeps saying it can't find the device" in context

        # The reply adds to the report: its causes are merged with the earlier answer's,
        # (earlier + 0.25 x reply) / 1.25 for a reply with no error of its own
        # (pipeline.with_earlier_answer).
        reply = await ask(app, pilot, "what if I use gloo?")
        scores = {c.id: round(c.score, 3) for c in reply.turn.result.causes}
        assert scores == {
            "duplicate-gpu-per-rank": 0.74,
            "set-device-order": 0.648,
            "master-endpoint-mismatch": 0.32,
            "nccl-with-cpu-tensors": 0.132,
        }


async def test_a_chinese_answer_asks_in_chinese():
    app = fake_app()
    async with app.run_test(size=(120, 40)) as pilot:
        view = await ask(app, pilot, "我只有一张卡，DDP 一直报错找不到设备")
        decide = widget_text(view.query_one(".turn-decide"), width=400)
        assert "为了区分这几个原因，请粘贴：" in decide
        assert "把握：" in widget_text(view.query_one(".turn-status"), width=300)
        details = " ".join(detail_lines(view))
        assert "已在本机测试：" in details or "已在本机测试:" in details
        assert "tested" not in details and "confirmed" not in " ".join(verdict_column(view))
