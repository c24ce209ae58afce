"""`assistant run` on real NCCL launches recorded on an NVIDIA H200 (tests/fixtures/gpu/runs.json).

tests/gpu/record_runs.py watched tests/gpu/jobs/ there (torch 2.11.0+cu130,
NCCL 2.28.9): two ranks on the one GPU, a rank asking for a GPU that is not
there, NCCL given a CPU tensor, DDP around a CPU model, CUDA out of memory,
a device-side assert, a NCCL hang and a process-group timeout. Here the
readers run on the raw files those ranks left (flight-recorder dumps,
faulthandler stacks) and the diagnosis (the real KB, lint of the same job
script, verdicts) runs on the recorded reports.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from assistant.probing.recorded import RecordedRunner
from assistant.results import RootError
from assistant.watch.flight import compare, last_collective
from assistant.watch.hang import RankPosition, analyse
from assistant.watch.recorded import load_launches, report_from_json, report_to_json
from assistant.watch.session import RunOptions, diagnose
from assistant.watch.stacks import innermost_user_frame, main_thread, parse_dump, waiting_in

TESTS = Path(__file__).parents[1]
RECORDED = TESTS / "fixtures" / "gpu" / "runs.json"
FACTS = TESTS / "fixtures" / "facts"
JOBS = TESTS / "gpu" / "jobs"
HANG = "rank0_only_all_reduce_hang"


@pytest.fixture(scope="module")
def launches():
    return load_launches(RECORDED)


def here(report):
    """The recorded report with its job script at this checkout's path (lint reads it)."""
    return replace(
        report, command=[*report.command[:-1], str(JOBS / Path(report.command[-1]).name)]
    )


def rank_files(run, suffix):
    """rank -> the raw file that rank's process left (pid-named on the GPU machine)."""
    by_pid = {f"{rank.pid}{suffix}": rank.rank for rank in run["report"].ranks}
    return {by_pid[name]: data for name, data in run["files"].items() if name in by_pid}


def test_every_recorded_report_reads_back_unchanged(launches):
    for run in launches.values():
        data = report_to_json(run["report"])
        assert report_to_json(report_from_json(data)) == data


def test_cudas_initialization_error_in_a_forked_worker_points_at_the_fork(launches):
    """The recorded error alone (no script): CUDA's "initialization error" from a
    DataLoader worker points at the fork, and only points (a driver that failed to
    load prints it too); the script's finding confirms it (EXPECTED above)."""
    from assistant.verdicts import judge

    root = launches["cuda_tensors_in_forked_workers"]["report"].root_error
    assert "CUDA error: initialization error" in root.message
    found = judge("cuda-init-before-fork", {}, root, [])
    assert (found.verdict, found.source) == ("inconclusive", "error")
    assert judge("cuda-init-before-fork", {}, RootError("RuntimeError", "boom"), []).verdict == (
        "not_run"
    )


def test_a_clean_cuda_job_under_the_hook_is_no_failure(launches):
    report = launches["healthy_ddp"]["report"]
    assert report.exit_code == 0 and not report.failed
    assert "done, last loss" in launches["healthy_ddp"]["output"]


def test_real_stack_dumps_place_each_rank_of_a_nccl_hang(launches):
    """faulthandler's dumps on the GPU machine's Python 3.12: where each rank waits."""
    stacks = rank_files(launches[HANG], ".stacks")
    threads = {rank: main_thread(parse_dump(text), None) for rank, text in stacks.items()}
    assert {rank: waiting_in(t.frames) for rank, t in threads.items()} == {
        0: "all_reduce",
        1: "barrier",
    }
    where = {rank: innermost_user_frame(t.frames) for rank, t in threads.items()}
    assert {rank: (f.line, f.function) for rank, f in where.items()} == {
        0: (19, "main"),
        1: (21, "main"),
    }
    positions = [
        RankPosition(rank, True, where[rank], waiting_in(threads[rank].frames)) for rank in (0, 1)
    ]
    hang = analyse(positions, 20.0)
    assert hang.cause_id == "collective-mismatch" and hang.odd_ranks


def test_real_flight_recorders_say_only_what_they_hold(launches):
    """Rank 0 waits in a NCCL all_reduce whose communicator never came up: its recorder is
    empty; rank 1's only entry is a barrier on its gloo group. Neither is "issued nothing"."""
    dumps = rank_files(launches[HANG], ".fr.json")
    last = {rank: last_collective(dump) for rank, dump in dumps.items()}
    assert last[0].seq == 0 and last[0].elsewhere == ""
    assert last[1].seq == 0 and last[1].elsewhere == "gloo:barrier on group 1 (scheduled)"
    assert compare(last) == [
        "flight recorder: rank 0 has recorded no collective on the default group",
        (
            "flight recorder: rank 1 has recorded no collective on the default group; "
            "its last entry: gloo:barrier on group 1 (scheduled)"
        ),
    ]


EXPECTED = {
    # name: (first cause, its verdict, where the verdict comes from, confidence)
    "two_ranks_on_cuda0": ("duplicate-gpu-per-rank", "confirmed", "error", "high"),
    # the script's line first (lint of the same job), the error's agreeing after it
    "nccl_cpu_tensor": ("nccl-with-cpu-tensors", "confirmed", "script", "high"),
    "cpu_module_device_ids": ("ddp-device-ids-cpu-module", "confirmed", "script", "high"),
    "cuda_oom": ("cuda-out-of-memory", "confirmed", "error", "high"),
    "label_out_of_range": ("device-side-assert", "confirmed", "error", "high"),
    "local_rank_beyond_gpus": ("world-size-exceeds-devices", "inconclusive", "error", "high"),
    # CUDA tensors a dataset made in the parent, read in forked workers: "CUDA error:
    # initialization error"; .cuda() in a forked worker: "Cannot re-initialize CUDA"
    "cuda_tensors_in_forked_workers": ("cuda-init-before-fork", "confirmed", "script", "high"),
    "cuda_in_forked_worker_getitem": ("cuda-init-before-fork", "confirmed", "script", "high"),
    HANG: ("collective-mismatch", "confirmed", "probe", "high"),
    # a gloo timeout on rank 1 is the root error; the script shows why, not the error
    "rank0_only_all_reduce_timeout": ("collective-mismatch", "confirmed", "script", "medium"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recorded_failure_gets_its_cause_first(name, launches, engine):
    outcome = diagnose(here(launches[name]["report"]), RunOptions(probe=False), engine)
    first = outcome.result.causes[0]
    verdict = first.verdict
    confidence = outcome.to_json()["confidence"]
    assert (first.id, verdict.verdict, verdict.source, confidence) == EXPECTED[name]


@pytest.mark.slow
def test_the_hang_answer_names_both_ranks_from_the_running_job(launches, engine):
    run = launches[HANG]
    report = here(run["report"])
    # The flight lines as this code writes them from the ranks' real dumps.
    dumps = rank_files(run, ".fr.json")
    report.flight = compare({rank: last_collective(dump) for rank, dump in dumps.items()})
    outcome = diagnose(report, RunOptions(probe=False), engine)
    evidence = outcome.result.causes[0].verdict.evidence
    assert any(
        line.startswith("the running job, ") and "rank 1 waits in barrier" in line
        for line in evidence
    )
    assert any("runs on rank 0 only" in line for line in evidence)  # the script's own `if`
    assert "issued no collective" not in outcome.result.query


@pytest.mark.slow
def test_probes_recorded_on_the_same_machine_confirm_too_few_gpus(launches, engine):
    """The invalid-ordinal launch, diagnosed with the probe facts of that H200 (2 ranks, 1 GPU)."""
    runner = RecordedRunner(FACTS / "h200_2ranks_one_gpu.json")
    report = here(launches["local_rank_beyond_gpus"]["report"])
    outcome = diagnose(report, RunOptions(probe=True), engine, runner=runner)
    first = outcome.result.causes[0]
    assert (first.id, first.verdict.verdict, first.verdict.source) == (
        "world-size-exceeds-devices",
        "confirmed",
        "probe",
    )
    assert runner.calls, "the probes were not asked"
    assert outcome.to_json()["confidence"] == "high"
