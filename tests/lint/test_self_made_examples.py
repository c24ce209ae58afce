"""Examples a rank makes itself in its training loop (self-play games, episodes),
trained on through a DataLoader (assistant/lint/checks/data.py): each rank's data is
its own, so no DistributedSampler is missing, but a game that lasts until it ends
gives each rank its own number of batches (uneven-inputs) unless the steps agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "self_play_games_of_their_own_length_trained_without_join.py"
FIXED = SCRIPTS / "correct_self_play_games_trained_under_join.py"

PRELUDE = """
import glob
import random
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
"""

# Blind set is's 14 (uneven-inputs) and 19 (correct, under join()).
SELF_PLAY = """
def play(net):
    hist = []
    while not game_over(hist):
        hist.append((encode(hist), search(net, hist)))
    return [(board, policy, outcome(hist)) for board, policy in hist]


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    SEED
    net = Net().cuda()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(100):
        fresh = []
        for _ in range(32):
            fresh += play(net)
        ds = TensorDataset(*map(torch.tensor, zip(*fresh)))
        loader = DataLoader(ds, batch_size=256, shuffle=True, drop_last=True)
        TRAIN
"""
TRAIN = """for x, pi, z in loader:
            loss(model(x), pi, z).backward()
            opt.step()"""
UNDER_JOIN = """with model.join():
            for x, pi, z in loader:
                loss(model(x), pi, z).backward()
                opt.step()"""
PER_RANK_SEED = "np.random.seed(7 + rank)"


def reported(body: str) -> list[tuple[str, int]]:
    findings = lint_snippet(PRELUDE, body, ["uneven-inputs", "missing-distributed-sampler"])
    return [(f.cause_id, line) for line, f in findings]


@pytest.mark.parametrize(
    ("seed", "train", "expected"),
    [
        (PER_RANK_SEED, TRAIN, [("uneven-inputs", 21)]),
        (PER_RANK_SEED, UNDER_JOIN, []),
        # the same seed on every rank: the ranks play the same games, each trains on all
        ("np.random.seed(7)", UNDER_JOIN, [("missing-distributed-sampler", 21)]),
    ],
    ids=["own games", "under join", "same games on every rank"],
)
def test_games_each_rank_plays_for_itself(seed, train, expected):
    body = SELF_PLAY.replace("SEED", seed).replace("TRAIN", train)
    assert reported(body) == expected


def test_examples_read_from_files_each_round_are_not_made_here():
    # blind set is's 03: a window of game files, the same on every rank, read each round
    body = """
def newest_files(folder, count):
    while True:
        files = sorted(glob.glob(folder + "/*.npz"))
        if len(files) >= count:
            return files[-count:]


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    np.random.seed(7 + rank)
    model = DDP(Net().cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(100):
        ds = Window(newest_files("games", 8))
        loader = DataLoader(ds, batch_size=256, shuffle=True)
        for x, z in loader:
            loss(model(x), z).backward()
            opt.step()
"""
    assert reported(body) == [("missing-distributed-sampler", 17)]


@pytest.mark.slow
def test_own_games_fall_out_of_step_under_torchrun_and_the_twin_joins(torchrun):
    assert_broken_fails_and_twin_runs(torchrun, BROKEN, RANKS_STOPPED_MATCHING, FIXED, "finished")
