"""`assistant run` on real hangs: every rank's stack without killing, the odd rank named, the cause.

Real torchrun, gloo, 2 CPU ranks. Each hang must be declared within
--hang-after of the job's last output (plus the stack taking and the
clean end), and leave no process.
"""

from __future__ import annotations

import time

import pytest
from watch_helpers import SCRIPTS, TORCHRUN, no_job_left

from assistant.watch.session import RunCallbacks, RunOptions, run_and_diagnose

pytestmark = pytest.mark.slow

HANG_AFTER = 6.0
SLACK = 6.0  # stacks (under a second), ending the job, and a loaded 2-core machine


def run_hang(script, tmp_path, engine, output):
    options = RunOptions(hang_after=HANG_AFTER, log_dir=tmp_path / "logs", probe=False)
    outcome = run_and_diagnose(
        [*TORCHRUN, str(SCRIPTS / script)],
        options,
        engine,
        RunCallbacks(
            on_output=output, on_launch=lambda launch: setattr(output, "ended", time.monotonic())
        ),
    )
    assert output.ended - output.last <= HANG_AFTER + SLACK
    assert no_job_left(tmp_path / "logs"), "a process of the job was left behind"
    launch = outcome.launch
    assert launch.hung and launch.exit_code is None
    assert outcome.to_json()["launch"]["hung"] is True
    return outcome, {r["rank"]: r for r in outcome.to_json()["ranks"]}


def first_confirmed(outcome):
    first = outcome.result.causes[0]
    assert first.verdict.verdict == "confirmed" and first.verdict.source == "probe"
    assert any(line.startswith("the running job, ") for line in first.verdict.evidence)
    return first


def test_a_rank_stuck_outside_any_collective_is_the_straggler(tmp_path, engine, output):
    outcome, ranks = run_hang("rank_one_sleeps_outside_collective.py", tmp_path, engine, output)
    assert ranks[0]["waiting_in"] == "all_reduce" and ranks[0]["where"]["line"] == 20
    assert ranks[1]["waiting_in"] is None
    assert (ranks[1]["where"]["line"], ranks[1]["where"]["function"]) == (10, "slow_preprocessing")
    assert outcome.launch.hang.odd_ranks == [1]
    assert first_confirmed(outcome).id == "collective-timeout"
    assert "rank(s) 1 never issued collective #1" in outcome.launch.flight[-1]
    assert any(
        "rank 1 is the straggler" in line for line in outcome.result.causes[0].verdict.evidence
    )


def test_a_busy_rank_outside_any_collective_is_a_straggler_too(tmp_path, engine, output):
    # Its stack keeps moving; only leaving a collective counts as progress after init.
    outcome, ranks = run_hang("rank_one_busy_loop_outside_collective.py", tmp_path, engine, output)
    assert (ranks[0]["waiting_in"], ranks[0]["where"]["line"]) == ("all_reduce", 21)
    assert ranks[1]["waiting_in"] is None and ranks[1]["where"]["line"] in (10, 11)
    assert ranks[1]["where"]["function"] == "endless_augmentation"
    assert outcome.launch.hang.odd_ranks == [1]
    assert first_confirmed(outcome).id == "collective-timeout"


def test_a_collective_only_rank_zero_issues_is_a_mismatch(tmp_path, engine, output):
    outcome, ranks = run_hang(
        "all_reduce_only_on_rank_zero_then_barrier.py", tmp_path, engine, output
    )
    assert (ranks[0]["waiting_in"], ranks[0]["where"]["line"]) == ("all_reduce", 14)
    assert (ranks[1]["waiting_in"], ranks[1]["where"]["line"]) == ("barrier", 15)
    assert outcome.launch.hang.odd_ranks == [0]
    assert first_confirmed(outcome).id == "collective-mismatch"
    # torch's flight recorder (on for the job) says the same: collective #1 differs.
    assert ranks[0]["last_collective"]["op"].endswith("all_reduce")
    assert ranks[1]["last_collective"]["op"].endswith("barrier")
    assert any("a mismatch" in line for line in outcome.launch.flight)


def test_a_rank_that_runs_out_of_batches_is_uneven_inputs(tmp_path, engine, output):
    outcome, ranks = run_hang("uneven_batches_rank_one_runs_out.py", tmp_path, engine, output)
    assert (ranks[0]["waiting_in"], ranks[0]["where"]["line"]) == ("all_reduce", 14)
    assert (ranks[1]["waiting_in"], ranks[1]["where"]["line"]) == ("barrier", 15)
    assert outcome.launch.hang.odd_ranks == [1]
    assert first_confirmed(outcome).id == "uneven-inputs"
