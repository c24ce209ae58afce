"""assistant/lint/checks/weighted_heads.py: a LightningModule's head that only a
loss weight turns on, the weight 0 by default, under strategy="ddp"
(unused-parameters). Lightning is not installed here: the failure itself is
the one the plain-DDP fixtures of test_unused_checks.py run under torchrun
("Expected to have finished reduction"); these are read only."""

from __future__ import annotations

import pytest

from assistant.lint import lint_source

CAUSE = "unused-parameters"
MODULE = """\
import argparse
from dataclasses import dataclass

import lightning.pytorch as pl
import torch.nn.functional as F
from torch import nn


@dataclass
class Cfg:
    aux_weight: float = {field}


class Model(pl.LightningModule):
    def __init__(self, cfg, recon_weight={init}):
        super().__init__()
        self.save_hyperparameters()
        self.cfg = cfg
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.decoder = nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.body(x)
        loss = F.mse_loss(self.head(h), y)
        if {test}:
            loss = loss + F.mse_loss(self.decoder(h), x)
        {extra}
        return loss


parser = argparse.ArgumentParser()
parser.add_argument("--recon-weight", type=float, default={flag})
trainer = pl.Trainer(devices=2, strategy={strategy})
"""


def lines(
    test="self.hparams.recon_weight > 0",
    init="0.0",
    flag="0.0",
    field="0.0",
    strategy='"ddp"',
    extra="",
) -> list[int]:
    source = MODULE.format(
        test=test, init=init, flag=flag, field=field, strategy=strategy, extra=extra
    )
    return [finding.line for finding in lint_source(source) if finding.cause_id == CAUSE]


GATE_LINE = 27  # the `if` of training_step in MODULE


@pytest.mark.parametrize(
    "change",
    [
        {},  # the module's and the flag's defaults
        {"test": "self.cfg.aux_weight > 0"},  # a config dataclass's field
        {"test": "self.hparams.recon_weight != 0", "strategy": "DDPStrategy()"},
        {"strategy": '"ddp_spawn"'},
    ],
)
def test_a_head_only_a_zero_default_weight_turns_on_is_reported(change):
    assert lines(**change) == [GATE_LINE]


@pytest.mark.parametrize(
    "change",
    [
        {"init": "0.5", "flag": "0.5"},  # on by default
        {"flag": "1.0"},  # one default of the file turns it on
        {"strategy": '"ddp_find_unused_parameters_true"'},
        {"strategy": "DDPStrategy(find_unused_parameters=True)"},
        {"strategy": '"auto"'},  # not judged: what "auto" picks depends on the machine
        # the head also runs outside the gate: it always gets a gradient
        {"extra": "loss = loss + 0.0 * self.decoder(h).sum()"},
        # a test on the batch, not on a weight
        {"test": "batch_idx % 2 == 0"},
    ],
)
def test_a_weight_on_by_default_a_tolerant_strategy_or_another_use_is_quiet(change):
    assert lines(**change) == []


TASK_HEADS = """\
import lightning.pytorch as pl
import torch.nn.functional as F
from torch import nn


class Incremental(pl.LightningModule):
    def __init__(self, tasks=5):
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(tasks))
        self.current_task = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.heads[CHOOSER](self.backbone(x)), y)


trainer = pl.Trainer(devices=2, strategy=STRATEGY)
"""


def picked(chooser: str = "self.current_task", strategy: str = '"ddp"') -> list[int]:
    source = TASK_HEADS.replace("CHOOSER", chooser).replace("STRATEGY", strategy)
    return [f.line for f in lint_source(source) if f.cause_id == CAUSE]


def test_one_task_head_a_field_picks_each_step_is_reported_under_a_strict_strategy():
    # blind set ax: learning without forgetting, one head per task, all built at once
    assert picked() == [15]
    assert picked(strategy="DDPStrategy(process_group_backend='nccl')") == [15]


@pytest.mark.parametrize(
    "chooser, strategy",
    [
        ("self.current_task", '"ddp_find_unused_parameters_true"'),
        ("self.current_task", "DDPStrategy(find_unused_parameters=True)"),
    ],
)
def test_a_strategy_that_finds_unused_parameters_is_quiet(chooser, strategy):
    assert picked(chooser, strategy) == []
