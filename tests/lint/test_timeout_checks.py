"""collective-timeout: the other ranks wait in a collective while rank 0 alone
walks data (an evaluation), under a process-group timeout shortened below
NCCL's default (assistant/lint/checks/timeouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"

HEADER = """
import argparse
import datetime
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--pg-timeout-min", type=int, default=5)
args = parser.parse_args()
"""

STEP = """
def validate(model, loader):
    total = 0
    for x in loader:
        total += model(x).sum().item()
    return total

dist.init_process_group("nccl", timeout={timeout})
rank = dist.get_rank()
for epoch in range(10):
    train_one_epoch()
    if rank == 0:
        {work}
    dist.barrier()
"""


def reported(timeout: str, work: str) -> list[int]:
    body = STEP.replace("{timeout}", timeout).replace("{work}", work)
    return [line for line, _ in lint_snippet(HEADER, body, ["collective-timeout"])]


@pytest.mark.parametrize(
    "timeout",
    [
        "datetime.timedelta(minutes=5)",
        "datetime.timedelta(seconds=120)",
        # the timeout an argparse default gives
        "datetime.timedelta(minutes=args.pg_timeout_min)",
    ],
)
def test_rank_zero_walking_data_before_a_barrier_under_a_short_timeout(timeout):
    assert reported(timeout, "validate(model, val_loader)") == [14]


@pytest.mark.parametrize(
    ("timeout", "work"),
    [
        # NCCL's default, or longer
        ("datetime.timedelta(minutes=30)", "validate(model, val_loader)"),
        ("datetime.timedelta(hours=1)", "validate(model, val_loader)"),
        # a timeout the file cannot say
        ("datetime.timedelta(minutes=get_minutes())", "validate(model, val_loader)"),
        # rank 0 only saves or logs: no walk over data
        ("datetime.timedelta(minutes=5)", "print(epoch)"),
    ],
)
def test_a_long_or_unknown_timeout_or_short_rank_zero_work_is_quiet(timeout, work):
    assert reported(timeout, work) == []


def test_the_finding_names_the_work_and_the_timeout():
    [(_, finding)] = lint_snippet(
        HEADER,
        STEP.replace("{timeout}", "datetime.timedelta(minutes=5)").replace(
            "{work}", "validate(model, val_loader)"
        ),
        ["collective-timeout"],
    )
    assert "validate(model, val_loader)" in finding.message
    assert "5 min" in finding.message


@pytest.mark.slow
def test_the_fixture_times_out_under_torchrun_and_its_twin_runs(torchrun):
    # side by side (the helper starts both): the margins are in wall time (sleeps)
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "rank_zero_evaluates_past_a_short_timeout.py",
        ("Timed out", "Application timeout caused pair closure"),
        SCRIPTS / "correct_evaluation_shared_under_a_short_timeout.py",
        "finished",
    )
