"""uneven-inputs: a step one rank skips on its own data, before the gradient
all-reduce the other ranks wait in (the fixture holds a NaN loss and an empty
batch; these hold a batch with no targets)."""

from __future__ import annotations

from snippets import lint_snippet

HEADER = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
model = DDP(net)
"""


def skipped_lines(body: str) -> list[int]:
    return [line for line, _f in lint_snippet(HEADER, body, ["uneven-inputs"])]


def test_a_batch_whose_mask_or_labels_hold_no_target_is_a_skip_on_local_data():
    body = """
    for x, y, mask in loader:
        if not mask.any():
            continue
        model(x).sum().backward()
    for step, (x, labels) in enumerate(loader):
        if (labels != -100).sum() == 0:
            continue
        model(x).sum().backward()
    """
    assert skipped_lines(body) == [3, 7]


def test_a_skip_on_the_step_count_or_on_a_value_every_rank_agreed_on_is_quiet():
    body = """
    for step, (x, mask) in enumerate(loader):
        if step % 10 == 9:
            continue
        has_targets = mask.any().float()
        dist.all_reduce(has_targets, op=dist.ReduceOp.MIN)
        if not has_targets.item():
            continue
        model(x).sum().backward()
    """
    assert skipped_lines(body) == []


def test_a_rollout_value_compared_after_a_reduction_is_a_skip_on_local_data():
    # RL loops draw their batch inside the loop (`next(it)`, a rollout): the skip
    # reads a value the rank computed, not a loader's item.
    body = """
    for step in range(1000):
        rewards = rollout(next(it))
        adv = rewards - rewards.mean()
        if adv.abs().sum() == 0:
            continue
        model(adv).sum().backward()
    """
    assert skipped_lines(body) == [5]


def test_a_compared_reduction_every_rank_agreed_on_is_quiet():
    body = """
    for step in range(1000):
        adv = rollout(next(it))
        flat = adv.abs().sum()
        dist.all_reduce(flat, op=dist.ReduceOp.MIN)
        if flat.sum() == 0:
            continue
        model(adv).sum().backward()
    """
    assert skipped_lines(body) == []
