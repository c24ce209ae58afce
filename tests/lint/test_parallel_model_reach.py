"""collective-mismatch: the forward of a model whose layers issue collectives (tensor
parallelism written by hand: an autograd Function that all-reduces, a layer that
all-gathers its shards), run by some ranks only (blind set aw: validation of a
tensor-parallel LM on rank 0 alone). The fixture pair runs under torchrun: rank 0's
validation forward meets the other rank's training all-reduces and the job fails;
the twin evaluates on every rank and prints on rank 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
PRELUDE = """\
import torch
import torch.distributed as dist
from torch import nn


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        return torch.cat(parts, -1)


class ColumnParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.part = nn.Linear(8, 4)

    def forward(self, x):
        return Gather.apply(self.part(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ColumnParallel() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
"""


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(PRELUDE, body, ["collective-mismatch"])]


@pytest.mark.slow
def test_a_tensor_parallel_forward_on_rank_zero_fails_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "tensor_parallel_model_evaluated_on_rank_zero.py",
        RANKS_STOPPED_MATCHING,
        SCRIPTS / "correct_tensor_parallel_model_evaluated_on_every_rank.py",
        "trained 4 steps",
    )


def test_a_forward_of_a_model_whose_layers_gather_on_rank_zero_is_reported():
    body = """
    dist.init_process_group("nccl")
    model = Net().cuda()
    if dist.get_rank() == 0:
        print(model(torch.randn(2, 8)))
    """
    assert reported(body) == [5]


def test_a_model_handed_to_a_function_run_on_rank_zero_is_followed():
    body = """
    def evaluate(net, x):
        return net(x).sum()

    dist.init_process_group("nccl")
    model = Net()
    if dist.get_rank() == 0:
        evaluate(model, torch.randn(2, 8))
    """
    assert reported(body) == [3]


@pytest.mark.parametrize(
    "body",
    [
        # every rank runs the forward; rank 0 alone prints
        """
        dist.init_process_group("nccl")
        model = Net()
        out = model(torch.randn(2, 8))
        if dist.get_rank() == 0:
            print(out)
        """,
        # a model of plain layers: its forward on rank 0 alone needs nobody
        """
        dist.init_process_group("nccl")
        model = nn.Linear(8, 8)
        if dist.get_rank() == 0:
            print(model(torch.randn(2, 8)))
        """,
    ],
    ids=["every-rank", "plain-layers"],
)
def test_a_forward_every_rank_runs_or_one_that_needs_nobody_is_quiet(body):
    assert reported(body) == []
