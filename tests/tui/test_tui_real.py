"""The chat with the real probe runner: torchrun on CPU (gloo), two ranks.

Slow (a torchrun launch costs seconds). Skipped until assistant.probing.runner
exists; uses the real verdict functions when assistant.verdicts exists, the
fakes otherwise. The engine stays a fake so the test does not depend on the
embedding model.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from test_tui_fakes import (
    FakeEngine,
    fake_apply_verdicts,
    fake_doctor,
    fake_linter,
    fake_probes_for,
    screen_text,
)
from textual import events

from assistant.results import CauseResult
from assistant.tui.app import make_app
from assistant.tui.widgets import TurnView

runner_module = pytest.importorskip("assistant.probing.runner")

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

FINAL = {"ok", "failed", "timeout", "not_applicable", "error", "interrupted"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def verdict_functions():
    try:
        from assistant.verdicts import apply_verdicts, probes_for
    except ImportError:
        return fake_apply_verdicts, fake_probes_for
    return apply_verdicts, probes_for


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


def real_app(mark: str):
    apply_verdicts, probes_for = verdict_functions()
    runner = runner_module.ProbeRunner(nproc_per_node=2, timeout=90.0, env={"TUI_TEST_MARK": mark})
    return make_app(
        engine=CpuEngine(),
        runner=runner,
        linter=fake_linter,
        apply_verdicts=apply_verdicts,
        probes_for=probes_for,
        doctor=fake_doctor,
        cursor_blink=False,
    )


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


async def until(pilot, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        await pilot.pause(0.05)


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
        assert set(view.probe_rows) == {"backend", "rendezvous", "launch_env"}
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
    apply_verdicts, probes_for = verdict_functions()
    mark = uuid.uuid4().hex
    app = make_app(
        engine=engine,
        runner=runner_module.ProbeRunner(
            nproc_per_node=2, timeout=90.0, env={"TUI_TEST_MARK": mark}
        ),
        linter=fake_linter,
        apply_verdicts=apply_verdicts,
        probes_for=probes_for,
        doctor=fake_doctor,
        cursor_blink=False,
    )
    log = (
        "[rank1]: torch.distributed.DistBackendError: NCCL error in: "
        "../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.21.5\n"
        "[rank1]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "[rank1]: Last error:\n"
        "[rank1]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000\n"
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.model_phase == "ready", 120)
        app.post_message(events.Paste(log))
        await pilot.pause()
        await pilot.press("enter")
        answered = ("probing", "done", "failed")
        await until(pilot, lambda: app.turn_views and app.turn_views[0].phase in answered, 30)
        view = app.turn_views[0]
        # Causes at once: shown while the probes (a torchrun launch) still run.
        assert view.phase == "probing" and view.turn.result is not None
        assert "duplicate-gpu-per-rank" in [c.id for c in view.turn.result.causes][:3]
        await until(pilot, lambda: view.phase in ("done", "failed"), 240)
        assert view.phase == "done"
        assert all(row.status in FINAL for row in view.probe_rows.values())
    assert marked_processes(mark) == []
