"""The chat on the real pipeline with the real probe runner: torchrun on CPU (gloo), two ranks.

Slow (a torchrun launch costs seconds). The real Pipeline and verdicts run;
the first two tests keep a fake engine so they do not depend on the
embedding model, the last one uses the real engine too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from test_tui_fakes import FakeEngine, fake_deps, screen_text, until
from textual import events

from assistant.pipeline import Pipeline
from assistant.probing import runner as runner_module
from assistant.probing.registry import probe_names
from assistant.results import CauseResult
from assistant.tui.app import make_app
from assistant.tui.turn import TurnView

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

FINAL = {"ok", "failed", "timeout", "not_applicable", "error", "interrupted"}


class CpuEngine(FakeEngine):
    """Causes whose probes run on a CPU-only machine."""

    def ask(self, query, top=5, context=None):
        result = super().ask(query, top=top, context=context)
        result.causes = [
            CauseResult(
                id="nccl-with-cpu-tensors",
                title="NCCL backend used with CPU tensors",
                score=0.7,
                fix_code='dist.init_process_group("gloo")\n',
                probes=["backend"],
            ),
            CauseResult(
                id="master-endpoint-mismatch",
                title="Ranks disagree on MASTER_ADDR / MASTER_PORT",
                score=0.5,
                probes=["rendezvous", "launch_env"],
            ),
        ]
        return result


def real_runner(mark: str):
    return runner_module.ProbeRunner(nproc_per_node=2, timeout=90.0, env={"TUI_TEST_MARK": mark})


def real_app(mark: str, engine=None):
    """The chat on the real Pipeline and runner, through the same factory as run_chat."""
    deps = fake_deps(engine=engine or CpuEngine(), runner=real_runner(mark), pipeline_type=Pipeline)
    return make_app(deps)


async def paste_and_send(app, pilot, text: str) -> None:
    """Once the model is ready, paste `text` into the chat and send it."""
    await until(pilot, lambda: app.model_phase == "ready", 120)
    app.post_message(events.Paste(text))
    await pilot.pause()
    await pilot.press("enter")


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (torchrun and its workers)."""
    found = []
    needle = f"TUI_TEST_MARK={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if needle in environ and state != "Z":
            found.append(int(entry.name))
    return found


async def test_real_probes_report_progress_and_verdicts(monkeypatch):
    mark = uuid.uuid4().hex
    app = real_app(mark)
    # Record every progress event the view receives: a fast probe can start and
    # finish between two polls, so watching the rendered state alone would be flaky.
    events_seen: list[tuple[str, str, str]] = []
    original_event = TurnView.probe_event

    def recording_event(self, probe, state, elapsed, status):
        original_event(self, probe, state, elapsed, status)
        events_seen.append((probe, state, self.probe_rows[probe].state))

    monkeypatch.setattr(TurnView, "probe_event", recording_event)
    async with app.run_test(size=(120, 40)) as pilot:
        app.post_message(
            events.Paste("RuntimeError: No backend type associated with device type cpu")
        )
        await pilot.pause()
        await pilot.press("enter")
        await until(pilot, lambda: app.turn_views and app.turn_views[0].phase == "probing", 10)
        view = app.turn_views[0]

        await until(pilot, lambda: view.phase == "done", 180)
        # The pipeline launches every registered probe with the question.
        assert set(view.probe_rows) == set(probe_names())
        shown_running = {probe for probe, state, row in events_seen if row == "running"}
        assert shown_running == set(view.probe_rows), events_seen
        for probe in view.probe_rows:  # each row went running -> done, in that order
            states = [state for name, state, _ in events_seen if name == probe]
            assert states == ["started", "finished"], (probe, states)
        assert all(row.status in FINAL for row in view.probe_rows.values())
        runs = {run.name: run for run in view.turn.result.probes}
        assert runs["launch_env"].status == "ok" and len(runs["launch_env"].ranks) == 2
        assert all(c.verdict.verdict != "not_run" for c in view.turn.result.causes)
        assert "launch_env ok" in screen_text(app)
    assert marked_processes(mark) == []


async def test_quitting_while_real_probes_run_leaves_no_process_behind():
    mark = uuid.uuid4().hex
    app = real_app(mark)
    async with app.run_test(size=(80, 24)) as pilot:
        app.post_message(events.Paste("RuntimeError: connection refused on MASTER_PORT"))
        await pilot.pause()
        await pilot.press("enter")
        await until(pilot, lambda: marked_processes(mark), 60)  # torchrun is up
        await pilot.press("ctrl+q")
    assert not app.probes_running
    rows = app.turn_views[0].probe_rows.values()
    assert any(row.status == "interrupted" for row in rows), "quit came too late to test"
    deadline = time.monotonic() + 5
    while marked_processes(mark) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert marked_processes(mark) == []


async def test_real_engine_and_runner_answer_a_pasted_log(engine):
    """The whole chain: real retrieval (conftest's engine), real torchrun probes."""
    mark = uuid.uuid4().hex
    app = real_app(mark, engine=engine)
    log = (
        "[rank1]: torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.21.5\n"
        "[rank1]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "[rank1]: Last error:\n"
        "[rank1]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000\n"
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await paste_and_send(app, pilot, log)
        answered = ("probing", "done", "failed")
        await until(pilot, lambda: app.turn_views and app.turn_views[0].phase in answered, 30)
        view = app.turn_views[0]
        # Causes at once: shown while the probes (a torchrun launch) still run.
        assert view.phase == "probing" and view.turn.result is not None
        assert "duplicate-gpu-per-rank" in [c.id for c in view.turn.result.causes][:3]
        await until(pilot, lambda: view.phase in ("done", "failed"), 240)
        assert view.phase == "done"
        assert all(row.status in FINAL for row in view.probe_rows.values())
        result = view.turn.result
        assert result.confidence in ("high", "medium", "low")
        # Honest words: "tested on this machine" only where a probe decided.
        text = screen_text(app)
        for cause in result.causes:
            if cause.verdict.source != "probe":
                continue
            assert "tested on this machine" in text
        if result.confidence != "high" and result.decide:
            assert "To tell these apart, paste:" in text
    assert marked_processes(mark) == []


async def test_code_pasted_into_the_chat_is_linted_and_shown_as_the_evidence(engine):
    """Real retrieval and the real pipeline (probes replayed): the pasted loop's
    barrier under a rank-0 test confirms collective-mismatch, in its own words."""
    app = make_app(fake_deps(engine=engine, pipeline_type=Pipeline))
    question = (
        "validation hangs at the end of every epoch on 4 GPUs\n"
        "```python\n"
        "def on_validation_epoch_end(self):\n"
        "    if self.trainer.is_global_zero:\n"
        "        scores = self.all_gather(torch.stack(self.scores))\n"
        "        self.print(scores.mean())\n"
        "```\n"
    )
    async with app.run_test(size=(140, 50)) as pilot:
        await paste_and_send(app, pilot, question)
        await until(pilot, lambda: app.turn_views and app.turn_views[0].phase == "done", 120)
        first = app.turn_views[0].turn.result.causes[0]
        assert (first.id, first.verdict.verdict) == ("collective-mismatch", "confirmed")
        assert "the code in the question, line 5" in " ".join(screen_text(app).split())
