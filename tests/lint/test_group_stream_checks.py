"""assistant/lint/checks/batching.py: a dataset or sampler of the file that deals
whole groups (shards, files, videos) out by rank and yields what each group holds,
trained on until the loader runs out (uneven-inputs).

The groups hold different numbers of samples, so each rank's epoch has its own
number of batches even when the groups share out evenly; the ranks still training
wait in DDP's gradient all-reduce for the ones that ran out. The fixture pair runs
under torchrun: the broken one hangs at the end of rank 1's shard, its twin cycles
the stream and trains a fixed number of steps on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
CAUSE = "uneven-inputs"
PRELUDE = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, Sampler
"""
STREAM = """
class Stream(IterableDataset):
    def __init__(self, files, rank, world):
        self.files, self.rank, self.world = files, rank, world

    def _mine(self):
        return self.files[self.rank::self.world]

    def __iter__(self):
        ITERATE


dist.init_process_group("nccl")
model = DDP(net)
loader = DataLoader(Stream(files, dist.get_rank(), dist.get_world_size()), batch_size=8)
for epoch in range(3):
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
        STOP
"""


def reported(iterate: str, stop: str = "pass") -> list[int]:
    source = STREAM.replace("ITERATE", iterate).replace("STOP", stop)
    return [line for line, _ in lint_snippet(PRELUDE, source, {CAUSE})]


@pytest.mark.slow
def test_a_rank_whose_shards_hold_fewer_samples_leaves_the_other_waiting(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "shards_dealt_by_rank_then_expanded.py",
        RANKS_STOPPED_MATCHING,
        SCRIPTS / "correct_shards_dealt_by_rank_cycled_for_fixed_steps.py",
        "trained 3 steps",
    )


@pytest.mark.parametrize(
    "iterate",
    [
        # each file's windows, through a method of the class (blind set hn's 09)
        (
            "for path in self._mine():\n"
            "            for t in range(len(read(path)) - 4):\n"
            "                yield read(path)[t:t + 4]"
        ),
        # each video's clips, dealt out as whole videos (blind set ho's 19)
        "for v in self.files[self.rank::self.world]:\n            yield from clips_of(v)",
        # each recording read block by block until it ends (blind set hy's 10)
        (
            "for path in self._mine():\n"
            "            f = open_audio(path)\n"
            "            while True:\n"
            "                block = f.read(4096)\n"
            "                if len(block) == 0:\n"
            "                    break\n"
            "                yield block"
        ),
    ],
    ids=["windows of each file", "clips of each video", "blocks until the file ends"],
)
def test_groups_dealt_by_rank_and_yielded_whole_are_reported(iterate):
    assert reported(iterate) == [7]


@pytest.mark.parametrize(
    ("iterate", "stop"),
    [
        # an endless stream: the training loop cuts it at a count of its own
        (
            (
                "while True:\n            for path in self._mine():\n"
                "                yield from read(path)"
            ),
            "pass",
        ),
        # a fixed number of samples per item, whatever the data holds
        (
            "for path in self._mine():\n            for k in range(4):\n                yield path, k",
            "pass",
        ),
        # the loop leaves after a cap on the steps
        ("for path in self._mine():\n            yield from read(path)", "break"),
    ],
    ids=["endless stream", "fixed repeats", "a step cap"],
)
def test_a_stream_every_rank_steps_through_alike_is_quiet(iterate, stop):
    assert reported(iterate, stop) == []
