"""collective-mismatch: rank 0 alone calls the DDP wrapper's forward (an evaluation)
over a model with BatchNorm while DDP broadcasts buffers: that forward is a
collective the other ranks never join (assistant/lint/checks/collective_reach.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"

HEADER = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

def evaluate(model, loader):
    return [model(x) for x in loader]

def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
"""


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["collective-mismatch"])]


BN_MODEL = "nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))"


@pytest.mark.parametrize(
    "body",
    [
        # the wrapper called in main's rank-0 branch
        f"""
    model = DDP({BN_MODEL})
    if rank == 0:
        out = model(torch.randn(2, 4))
    dist.barrier()
""",
        # handed to a function as the wrapper, which calls it
        f"""
    model = DDP({BN_MODEL})
    if rank == 0:
        evaluate(model, val_loader)
    dist.barrier()
""",
        # a torchvision model built of BatchNorm
        """
    import torchvision
    net = DDP(torchvision.models.resnet18())
    if rank == 0:
        net(torch.randn(1, 3, 32, 32))
    dist.barrier()
""",
    ],
)
def test_rank_zero_alone_calling_the_wrapper_is_reported(body):
    assert reported(body) != []


@pytest.mark.parametrize(
    "body",
    [
        # the module DDP wraps: a plain forward
        f"""
    model = DDP({BN_MODEL})
    if rank == 0:
        evaluate(model.module, val_loader)
    dist.barrier()
""",
        f"""
    model = DDP({BN_MODEL})
    if rank == 0:
        model.module(torch.randn(2, 4))
    dist.barrier()
""",
        # rebound to the module before the call
        f"""
    model = DDP({BN_MODEL})
    model = model.module
    if rank == 0:
        model(torch.randn(2, 4))
    dist.barrier()
""",
        # DDP told not to broadcast buffers
        f"""
    model = DDP({BN_MODEL}, broadcast_buffers=False)
    if rank == 0:
        model(torch.randn(2, 4))
    dist.barrier()
""",
        # no BatchNorm: nothing to broadcast
        """
    model = DDP(nn.Linear(4, 4))
    if rank == 0:
        model(torch.randn(2, 4))
    dist.barrier()
""",
        # every rank evaluates
        f"""
    model = DDP({BN_MODEL})
    evaluate(model, val_loader)
    dist.barrier()
""",
    ],
)
def test_the_module_itself_no_buffers_or_every_rank_calling_is_quiet(body):
    assert reported(body) == []


def test_the_finding_says_the_forward_is_a_collective():
    [(_, finding)] = lint_snippet(
        HEADER,
        f"""
    model = DDP({BN_MODEL})
    if rank == 0:
        model(torch.randn(2, 4))
    dist.barrier()
""",
        ["collective-mismatch"],
    )
    assert "broadcasts rank 0's buffers" in finding.message
    assert "model.module" in finding.message


@pytest.mark.slow
def test_the_fixture_times_out_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "rank_zero_evaluates_through_the_ddp_wrapper.py",
        RANKS_STOPPED_MATCHING,
        SCRIPTS / "correct_rank_zero_evaluates_the_wrapped_module.py",
        "trained",
    )
