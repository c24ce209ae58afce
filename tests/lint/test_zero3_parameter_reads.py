"""zero3-partitioned-parameters: a parameter the file's own class declares, read
straight off the engine's module outside the engine's forward, under ZeRO stage 3:
each rank holds a placeholder of torch.Size([0]) there (assistant/lint/checks/zero.py)."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

SCRIPT = """
import deepspeed
import torch
from torch import nn
import torch.nn.functional as F


class Quantizer(nn.Module):
    def __init__(self, groups, entries, dim):
        super().__init__()
        self.codevectors = nn.Parameter(torch.empty(groups * entries, dim).uniform_())
        self.logit_scale = nn.Parameter(torch.ones([]))

    def forward(self, x):
        return x @ self.codevectors.T * self.logit_scale.exp()


config = {"train_batch_size": 8, "zero_optimization": {"stage": STAGE}}
engine, optimizer, _, _ = deepspeed.initialize(model=Quantizer(2, 320, 64), config=config)
for step, x in enumerate(loader):
    loss = engine(x).mean()
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        READ
"""


def reported(read: str, stage: str = "3") -> list[int]:
    source = SCRIPT.replace("STAGE", stage).replace("READ", read)
    return [line for line, _ in lint_snippet("", source, ["zero3-partitioned-parameters"])]


@pytest.mark.parametrize(
    "read, stage, lines",
    [
        # blind set ht's 06: the codebook's statistics read off the engine's module
        ("cv = engine.module.codevectors.detach().float().view(2, 320, -1)", "3", [25]),
        ("model = engine.module\n        cv = F.normalize(model.codevectors, dim=-1)", "3", [26]),
        # a scalar DeepSpeed keeps whole on every rank (under its persistence threshold)
        ("t = engine.module.logit_scale.exp().item()", "3", []),
        # DeepSpeed's record of the full shape, a gather around the read, stage 2
        ("shape = engine.module.codevectors.ds_shape", "3", []),
        (
            (
                "with deepspeed.zero.GatheredParameters(engine.module.codevectors):\n"
                "            cv = engine.module.codevectors.view(2, 320, -1)"
            ),
            "3",
            [],
        ),
        ("cv = engine.module.codevectors.view(2, 320, -1)", "2", []),
    ],
    ids=["codebook view", "through a name", "scalar", "ds_shape", "gathered", "stage 2"],
)
def test_a_declared_parameter_read_off_the_engine_outside_a_gather(read, stage, lines):
    assert reported(read, stage) == lines


def test_a_file_that_sets_the_persistence_threshold_is_left_alone():
    source = SCRIPT.replace(
        '"stage": STAGE}', '"stage": 3, "stage3_param_persistence_threshold": 10**7}'
    ).replace("READ", "cv = engine.module.codevectors.view(2, 320, -1)")
    assert lint_snippet("", source, ["zero3-partitioned-parameters"]) == []
