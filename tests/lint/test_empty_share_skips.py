"""collective-mismatch: a skip taken when this rank's own share is empty (`if not mine:
continue`), ahead of the collectives the other ranks wait in
(assistant/lint/checks/collective_reach.py). Federated rounds that sample clients
anew leave some rank without one; a strided share of fewer items than ranks too."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "federated_rounds_a_rank_without_clients_skips.py"
FIXED = SCRIPTS / "correct_federated_rounds_a_rank_without_clients_adds_zeros.py"

PRELUDE = """
import numpy as np
import torch
import torch.distributed as dist
"""

# Blind set jo's 20: Poisson client sampling, a rank without a participant skips.
ROUNDS = """
def main(users, rounds):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    for rnd in range(rounds):
        picked = np.flatnonzero(np.random.default_rng(rnd).random(len(users)) < 0.1)
        mine = SHARE
        if TEST:
            SKIP
        sums = torch.zeros(10, device="cuda")
        for c in mine:
            sums += train(users[c])
        dist.all_reduce(sums)
"""


def reported(share: str, test: str = "not mine", skip: str = "continue") -> list[int]:
    body = ROUNDS.replace("SHARE", share).replace("TEST", test).replace("SKIP", skip)
    return [line for line, _ in lint_snippet(PRELUDE, body, ["collective-mismatch"])]


@pytest.mark.parametrize(
    ("share", "test", "lines"),
    [
        ("[c for c in picked if c % world == rank]", "not mine", [8]),
        ("[c for c in picked if c % world == rank]", "len(mine) == 0", [8]),
        ("picked[rank::world]", "len(mine) < 1", [8]),
        ("list(range(rank, len(picked), world))", "not mine", []),  # not the share itself
        ("[c for c in picked]", "not mine", []),  # the same list on every rank: all skip alike
        ("[c for c in picked if c % world == rank]", "rnd == 0", []),  # the same test everywhere
    ],
    ids=["comprehension", "len == 0", "strided slice", "wrapped", "every rank's", "not emptiness"],
)
def test_a_skip_when_this_ranks_share_is_empty_leaves_the_collectives(share, test, lines):
    assert reported(share, test) == lines


def test_a_skip_after_the_collectives_leaves_none_behind():
    body = """
def main(users, rounds):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    for rnd in range(rounds):
        mine = [c for c in range(len(users)) if c % world == rank]
        sums = torch.zeros(10, device="cuda")
        dist.all_reduce(sums)
        if not mine:
            continue
        log(sums)
"""
    assert lint_snippet(PRELUDE, body, ["collective-mismatch"]) == []


def test_a_return_on_an_empty_share_leaves_the_rest_of_the_function():
    body = """
def evaluate(items):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = items[rank::world]
    if not mine:
        return None
    scores = torch.tensor([score(x) for x in mine]).sum()
    dist.all_reduce(scores)
    return scores


def main(items):
    dist.init_process_group("nccl")
    return evaluate(items)
"""
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["collective-mismatch"])] == [5]


@pytest.mark.slow
def test_a_rank_without_clients_falls_out_of_step_under_torchrun_and_the_twin_adds_zeros(
    torchrun,
):
    assert_broken_fails_and_twin_runs(torchrun, BROKEN, RANKS_STOPPED_MATCHING, FIXED, "finished")
