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


@pytest.mark.parametrize(
    "threshold, lines",
    [
        # blind set ic's 15: DeepSpeed's default, written out
        ("1e5", [25]),
        # larger than any size read as computed: every parameter may stay whole
        ("1e7", []),
        ("args.persist", []),  # a value the run decides
    ],
)
def test_the_files_own_persistence_threshold_decides(threshold, lines):
    source = SCRIPT.replace(
        '"stage": STAGE}', f'"stage": 3, "stage3_param_persistence_threshold": {threshold}}}'
    ).replace("READ", "cv = engine.module.codevectors.view(2, 320, -1)")
    found = lint_snippet("", source, ["zero3-partitioned-parameters"])
    assert [line for line, _ in found] == lines


@pytest.mark.parametrize(
    "layer, read, lines",
    [
        # blind set ic's 15: an item table's weight read off the engine for a search
        ("nn.Embedding(n_items, 64)", "w = engine.module.table.weight.detach()", [25]),
        ("nn.Embedding(10, 8)", "w = engine.module.table.weight.detach()", []),  # kept whole
        ("nn.LayerNorm(64)", "w = engine.module.table.weight.detach()", []),  # not a matrix
    ],
    ids=["item table", "small literal table", "norm"],
)
def test_a_large_layers_weight_read_off_the_engine(layer, read, lines):
    source = (
        SCRIPT.replace("STAGE", "3")
        .replace("READ", read)
        .replace(
            "        self.logit_scale = nn.Parameter(torch.ones([]))\n",
            f"        self.logit_scale = nn.Parameter(torch.ones([]))\n        self.table = {layer}\n",
        )
    )
    found = lint_snippet("", source, ["zero3-partitioned-parameters"])
    assert [line for line, _ in found] == [line + 1 for line in lines]


EMA = """
import copy
import deepspeed
import torch
from torch import nn


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for p_ema, p in zip(ema_model.parameters(), model.parameters()):
        p_ema.mul_(decay).add_(p.detach(), alpha=1 - decay)


net = nn.Linear(512, 512)
ema = copy.deepcopy(net)
config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
engine, optimizer, _, _ = deepspeed.initialize(model=net, config=config)
for x in loader:
    engine.backward(engine(x).mean())
    engine.step()
    ema_update(ema, GIVEN, 0.999)
"""


@pytest.mark.parametrize(
    "given, lines",
    [
        # blind set if's 14: an EMA of the engine's weights, updated by a helper
        ("engine.module", [10]),
        ("net_copy", []),  # a module of its own, not the engine's
    ],
    ids=["engine's module", "another module"],
)
def test_an_ema_helper_given_the_engines_module_reads_placeholders(given, lines):
    found = lint_snippet("", EMA.replace("GIVEN", given), ["zero3-partitioned-parameters"])
    assert [line for line, _ in found] == lines
