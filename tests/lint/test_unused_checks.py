"""unused-parameters: a branch drawn at random that skips submodules under a DDP
that expects a gradient for every parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "random_branch_skips_a_submodule.py"
FIXED = SCRIPTS / "correct_random_branch_with_unused_parameters_found.py"

HEADER = """
import random
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])]


@pytest.mark.slow
def test_the_fixture_fails_as_linted_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        BROKEN,
        "Expected to have finished reduction in the prior iteration",
        FIXED,
        "trained",
    )


def test_layer_drop_in_a_block_the_model_builds_is_reported():
    lines = reported_lines(
        """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.mlp = nn.Linear(4, 4)
            def forward(self, x):
                if self.training and torch.rand(1).item() < 0.1:
                    return x
                return x + self.mlp(x)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block() for _ in range(4)])
            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        model = DDP(Net())
        """
    )
    assert lines == [7]


def test_random_values_outside_tests_or_tests_that_skip_no_submodule_are_not():
    lines = reported_lines(
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(4, 4)
            def forward(self, x):
                mask = torch.rand_like(x) < 0.1
                x = self.a(x.masked_fill(mask, 0.0))
                if random.random() < 0.5:
                    x = x.flip(0)
                return x

        model = DDP(Net())
        """
    )
    assert lines == []


def test_a_random_branch_under_a_ddp_that_finds_unused_parameters_is_not():
    lines = reported_lines(
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            def forward(self, x):
                if random.random() < 0.5:
                    return self.a(x)
                return self.b(x)

        model = DDP(Net(), find_unused_parameters=True)
        """
    )
    assert lines == []


DISCARDED = SCRIPTS / "output_discarded_by_the_training_step.py"
EVERY_OUTPUT = SCRIPTS / "correct_every_output_trained.py"


@pytest.mark.slow
def test_an_output_thrown_away_fails_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        DISCARDED,
        "Expected to have finished reduction in the prior iteration",
        EVERY_OUTPUT,
        "trained rank",
    )


HEADS = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.aux = nn.Linear(4, 1)
    def forward(self, x):
        h = self.body(x)
        return self.head(h), AUX
model = DDP(Net()OPTIONS)
for x in loader:
    UNPACK = model(x)
    loss_fn(out).backward()
"""


@pytest.mark.parametrize(
    ("aux", "unpack", "options", "reported"),
    [
        ("self.aux(h)", "out, _", "", [13]),
        ("self.aux(h)", "out, aux", "", []),  # both kept
        ("h.mean()", "out, _", "", []),  # the discarded output runs no submodule of its own
        ("self.head(h).sum()", "out, _", "", []),  # its submodule also feeds the kept output
        ("self.aux(h)", "out, _", ", find_unused_parameters=True", []),
    ],
    ids=["discarded-head", "kept", "no-submodule", "shared", "find-unused"],
)
def test_an_output_the_step_throws_away(aux, unpack, options, reported):
    body = HEADS.replace("AUX", aux).replace("UNPACK", unpack).replace("OPTIONS", options)
    assert [line for line, _ in lint_snippet(HEADER, body, ["unused-parameters"])] == reported
