"""assistant/lint/checks/data.py: webdataset shards split by node for training with
no fixed epoch length (uneven-inputs). Shards hold different numbers of samples, so
each rank's loader runs out after its own number of steps. The fixture pair runs
under torchrun with real tar shards: rank 1 leaves after 2 steps and rank 0's next
gradient all-reduce fails; the twin draws resampled shards with with_epoch(3), and
both ranks train 3 steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
CAUSE = "uneven-inputs"
PRELUDE = """\
import torch
import torch.distributed as dist
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
model = DDP(torch.nn.Linear(4, 1).cuda())
"""
TRAIN = """
for x, y in loader:
    model(x).sum().backward()
"""


@pytest.mark.slow
def test_a_rank_whose_shards_run_out_first_leaves_the_other_waiting_and_the_twin_does_not(
    torchrun,
):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "webdataset_shards_split_by_node_without_equal_steps.py",
        RANKS_STOPPED_MATCHING,
        SCRIPTS / "correct_webdataset_shards_resampled_with_epoch.py",
        "trained 3 steps",
    )


def findings(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(PRELUDE, body, {CAUSE})]


SPLIT = "ds = wds.WebDataset(URLS, nodesplitter=wds.split_by_node, shardshuffle=100)\n"
PIPELINE = (
    "ds = wds.DataPipeline(wds.SimpleShardList(URLS), wds.split_by_node, wds.split_by_worker,\n"
    "                      wds.shuffle(1000), wds.tarfile_to_samples())\n"
)


@pytest.mark.parametrize("made", [SPLIT, PIPELINE], ids=["WebDataset", "DataPipeline"])
def test_a_training_stream_split_by_node_without_a_fixed_length_is_flagged(made):
    body = made + "loader = wds.WebLoader(ds, batch_size=None)\n" + TRAIN
    assert findings(body) == [1]


@pytest.mark.parametrize(
    "body",
    [
        SPLIT + "loader = wds.WebLoader(ds, batch_size=None).with_epoch(1000)\n" + TRAIN,
        "ds = wds.WebDataset(URLS, resampled=True, nodesplitter=wds.split_by_node)\n"
        "loader = wds.WebLoader(ds).with_epoch(100)\n" + TRAIN,
        # an evaluation stream, read in order: no backward waits on it
        "ds = wds.WebDataset(URLS, nodesplitter=wds.split_by_node, shardshuffle=False)\n"
        "loader = wds.WebLoader(ds)\n" + TRAIN,
        SPLIT + "loader = wds.WebLoader(ds)\nwith model.join():\n" + TRAIN.replace("\n", "\n    "),
        SPLIT + "loader = wds.WebLoader(ds)\nfor x, y in loader:\n    model(x)\n",
    ],
    ids=["with_epoch", "resampled", "evaluation order", "DDP join", "no backward"],
)
def test_quiet_when_every_rank_runs_as_many_steps_or_none_trains(body):
    assert findings(body) == []


def test_a_deep_argument_is_read_without_recursion():
    """The stages are walked, not unparsed: 2,000 levels deep (past Python's recursion
    limit) the script is still linted, not refused as nested too deeply."""
    deep = "URLS" + " + URLS" * 2000
    body = SPLIT.replace("URLS", deep, 1) + "loader = wds.WebLoader(ds)\n" + TRAIN
    assert findings(body) == [1]
