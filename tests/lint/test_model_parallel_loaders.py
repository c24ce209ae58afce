"""assistant/lint/checks/data.py: ranks that hold parts of one model read the same
batches (blind set aw: a hand-written GPipe pipeline and a tensor-parallel LM, each
flagged for a loader without a DistributedSampler). Pipeline stages passing
activations and tensor-parallel layers that all-reduce in their forward need every
rank on the whole batch; a data-parallel wrapper, or gradients averaged by hand,
makes the ranks replicas again, which each need their own share."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

CAUSE = "missing-distributed-sampler"
PRELUDE = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
"""
TENSOR_PARALLEL = """
class RowParallel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        out = self.linear(x)
        dist.all_reduce(out)
        return out


def main(ds):
    dist.init_process_group("nccl")
    model = WRAP
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    for x in loader:
        model(x).sum().backward()
        AVERAGE
"""
PIPELINE = """
def main(ds):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    stage = torch.nn.Linear(8, 8)
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    for x in loader:
        if rank > 0:
            dist.recv(x, rank - 1)
        out = stage(x)
        dist.send(out, rank + 1)
        AVERAGE
"""
BY_HAND = "[dist.all_reduce(p.grad) for p in model.parameters()]"


def flagged(body: str, wrap: str = "RowParallel()", average: str = "pass") -> list[int]:
    source = body.replace("WRAP", wrap).replace("AVERAGE", average)
    return [line for line, _ in lint_snippet(PRELUDE, source, {CAUSE})]


@pytest.mark.parametrize("body", [TENSOR_PARALLEL, PIPELINE], ids=["tensor-parallel", "pipeline"])
def test_ranks_holding_parts_of_one_model_read_the_same_batches(body):
    assert flagged(body) == []


def test_a_data_parallel_wrapper_makes_the_ranks_replicas():
    assert flagged(TENSOR_PARALLEL, wrap="DDP(RowParallel())") == [16]


@pytest.mark.parametrize("body", [TENSOR_PARALLEL, PIPELINE], ids=["tensor-parallel", "pipeline"])
def test_gradients_averaged_by_hand_make_the_ranks_replicas(body):
    assert len(flagged(body.replace("stage = ", "model = stage = "), average=BY_HAND)) == 1
