"""The headless API the chat calls from a worker thread: callbacks, and a stop from another thread."""

from __future__ import annotations

import threading
import time

import pytest
from watch_helpers import SCRIPTS, TORCHRUN, no_job_left

from assistant.watch.session import RunCallbacks, RunOptions, run_and_diagnose

pytestmark = pytest.mark.slow


def test_a_worker_thread_runs_the_job_and_another_thread_stops_it(tmp_path):
    ready = threading.Event()
    cancel = threading.Event()
    seen: dict = {}

    def on_output(stream, data):
        if b"rank 1 ready" in data:
            ready.set()

    callbacks = RunCallbacks(
        on_output=on_output,
        on_launch=lambda launch: seen.setdefault("launch", launch),
        on_result=lambda outcome: seen.setdefault("outcome", outcome),
    )
    options = RunOptions(hang_after=600, log_dir=tmp_path / "logs", probe=False)
    command = [*TORCHRUN, str(SCRIPTS / "rank_one_sleeps_outside_collective.py")]
    worker = threading.Thread(
        target=run_and_diagnose, args=(command, options, None, callbacks, cancel)
    )
    worker.start()
    assert ready.wait(120), "the job never started"
    stopped_at = time.monotonic()
    cancel.set()
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - stopped_at < 15
    outcome = seen["outcome"]
    assert outcome.launch is seen["launch"] and outcome.launch.cancelled
    assert outcome.result is None and not outcome.launch.hung
    assert no_job_left(tmp_path / "logs")
