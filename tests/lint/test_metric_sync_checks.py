"""collective-mismatch: a torchmetrics metric computed on some ranks only.

A torchmetrics Metric (or MetricCollection) all-gathers every rank's state when it
computes, so `metric.compute()` under `if rank == 0:` is a collective that the
other ranks never join. Checked on snippets for the rule and its limits, and on
a fixture pair under torchrun: the broken one fails, its twin agrees on one AUROC.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import lint_snippet

from assistant.lint import lint_source

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "metric_computed_on_rank_zero_only.py"
FIXED = SCRIPTS / "correct_metric_computed_on_every_rank.py"

PRELUDE = """
import os
import torch
import torch.distributed as dist
import torchmetrics
from torchmetrics.classification import BinaryAUROC
dist.init_process_group("nccl")
rank = int(os.environ["RANK"])
"""


def reported(body: str, prelude: str = PRELUDE) -> list[int]:
    return [line for line, _ in lint_snippet(prelude, body, ["collective-mismatch"])]


def test_a_metric_computed_under_a_rank_test_is_reported_with_why():
    body = """
    auroc = BinaryAUROC()
    if rank == 0:
        print(auroc.compute())
    """
    (finding,) = [f for _, f in lint_snippet(PRELUDE, body, ["collective-mismatch"])]
    assert finding.line - PRELUDE.count("\n") == 4
    assert "auroc.compute()" in finding.message and "every rank's state" in finding.message


def test_a_module_attribute_metric_and_a_collection_are_reported_too():
    body = """
    class Model:
        def __init__(self):
            self.acc = torchmetrics.Accuracy(task="binary")
            self.metrics = torchmetrics.MetricCollection([BinaryAUROC()])

        def on_validation_epoch_end(self):
            if dist.get_rank() == 0:
                print(self.acc.compute(), self.metrics.compute())
    """
    assert reported(body) == [9, 9]


def test_every_rank_computing_or_both_branches_computing_is_quiet():
    body = """
    auroc = BinaryAUROC()
    value = auroc.compute()
    if rank == 0:
        print(value)
    if rank == 0:
        print(auroc.compute())
    else:
        auroc.compute()
    """
    assert reported(body) == []


def test_compute_of_an_object_that_is_not_a_torchmetrics_metric_is_quiet():
    body = """
    import evaluate
    accuracy = evaluate.load("accuracy")
    if rank == 0:
        print(accuracy.compute(predictions=[1], references=[1]))
    """
    assert reported(body) == []


OWN_LOGGER = """
class SmoothedValue:
    def __init__(self):
        self.total, self.count = 0.0, 0

    def synchronize_between_processes(self):
        t = torch.tensor([self.count, self.total], dtype=torch.float64)
        dist.barrier()
        dist.all_reduce(t)

class MetricLogger:
    def __init__(self):
        self.meters = {}

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

def evaluate(loader):
    metric_logger = MetricLogger()
    metric_logger.synchronize_between_processes()
    return metric_logger

if WHO:
    evaluate(val_loader)
"""


@pytest.mark.parametrize("who, reported_lines", [("rank == 0", [8, 9]), ("True", [])])
def test_a_collective_inside_the_files_own_object_methods_is_followed(who, reported_lines):
    # blind set ai's 19: DeiT-style evaluation on rank 0 alone; MetricLogger's sync
    # reaches SmoothedValue's barrier and all_reduce through `obj.method()` calls
    assert reported(OWN_LOGGER.replace("WHO", who)) == reported_lines


def test_a_common_method_name_on_an_object_is_not_taken_for_the_files_own():
    # `x.update()` may be a dict's: a file class's `update` is not assumed to run
    body = """
    class Meter:
        def update(self, value):
            dist.all_reduce(value)

    stats = {}
    if rank == 0:
        stats.update(loss=1.0)
    """
    assert reported(body) == []


def test_a_script_without_a_process_group_is_quiet():
    source = "from torchmetrics import Accuracy\nacc = Accuracy(task='binary')\nrank = 0\nif rank == 0:\n    acc.compute()\n"
    assert [f for f in lint_source(source) if f.cause_id == "collective-mismatch"] == []


@pytest.mark.slow
def test_rank_zero_alone_computing_fails_under_torchrun_and_the_twin_agrees(torchrun):
    assert [f.cause_id for f in lint_source(BROKEN.read_text())] == ["collective-mismatch"]
    assert lint_source(FIXED.read_text()) == []
    wait_failed, wait_ran = torchrun.start(BROKEN), torchrun.start(FIXED)
    failed = wait_failed()
    # gloo pairs rank 1's barrier with the first gather of compute(); rank 1 then
    # leaves and rank 0's next gather finds the peer gone (NCCL waits for the timeout)
    assert failed.returncode != 0
    assert "auroc" not in failed.stdout and "compute()" in failed.stderr
    ran = wait_ran()
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.count("auroc 0.781") == 2
