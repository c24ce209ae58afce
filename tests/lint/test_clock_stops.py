"""uneven-inputs: a training loop each rank leaves by its own clock
(assistant/lint/checks/clock_stops.py); under torchrun the fixture fails as linted
(the ranks' clocks start apart) and its twin, stopped by rank 0's broadcast, trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "scripts"

HEADER = """
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
"""

# blind set gj's 20: each variant benchmarked for a budget of seconds, per rank
BUDGET = """
def train_step(model, opt, x):
    loss = model(x).sum()
    loss.backward()
    opt.step()


def bench(args, x):
    dist.init_process_group("nccl")
    model = DDP(build())
    opt = torch.optim.AdamW(model.parameters())
    steps, start = 0, time.perf_counter()
    LOOP
        train_step(model, opt, x)
        steps += 1
        EXIT
"""


def reported(loop: str, exit_: str = "pass") -> list[int]:
    body = BUDGET.replace("LOOP", loop).replace("EXIT", exit_)
    return [line for line, _ in lint_snippet(HEADER, body, ["uneven-inputs"])]


def test_a_loop_each_rank_leaves_by_its_own_clock_is_reported():
    assert reported("while time.perf_counter() - start < args.seconds:") == [13]
    assert reported(
        "for _ in range(10**9):",
        "elapsed = time.perf_counter() - start\n        if elapsed > args.seconds:\n"
        "            break",
    ) == [17]


@pytest.mark.parametrize(
    "loop, exit_",
    [
        # a step count every rank shares (the clock read only beside it: `steps, start`)
        ("while steps < args.steps:", "pass"),
        # rank 0's clock, broadcast: every rank stops after the same step
        (
            "while True:",
            (
                "stop = torch.tensor([time.perf_counter() - start > args.seconds])\n"
                "        dist.broadcast(stop, src=0)\n        if stop.item():\n            break"
            ),
        ),
        # the clock read to log, not to stop
        ("for _ in range(args.steps):", "print(time.perf_counter() - start)"),
    ],
)
def test_quiet_where_the_ranks_stop_together(loop, exit_):
    assert reported(loop, exit_) == []


@pytest.mark.slow
def test_the_ranks_stop_apart_under_torchrun_and_the_broadcast_twin_trains(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "training_stopped_by_each_ranks_clock.py",
        RANKS_STOPPED_MATCHING,
        SCRIPTS / "correct_training_stopped_together_by_rank_zeros_clock.py",
        "trained rank",
    )
