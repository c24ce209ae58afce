"""assistant/lint/checks/seen_keys.py: a collective over one row per key that the
rank's own data filled into a dict (collective-mismatch). The fixture pair runs
under torchrun: the per-class counts of the classes each rank saw abort gloo,
the twin's counts over every class reduce on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
CAUSE = "collective-mismatch"
PRELUDE = """\
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 3))
NAMES = ["cat", "dog", "owl"]


def evaluate(loader, num_classes):
"""


def lines(body: str) -> list[int]:
    """Lines of `body`, run as evaluate()'s body, that the check reports."""
    indented = "".join(f"    {line}\n" for line in body.splitlines())
    return [line for line, _ in lint_snippet(PRELUDE, "", {CAUSE}, indented)]


@pytest.mark.slow
def test_the_counts_of_the_classes_each_rank_saw_abort_and_the_twin_reduces(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "all_reduce_of_the_classes_each_rank_saw.py",
        "Received data size doesn't match expected size",
        SCRIPTS / "correct_per_class_counts_over_every_class.py",
        "balanced accuracy 1.000",
    )


FILL_FROM_BATCHES = (
    "per_class = defaultdict(int)\n"
    "for x, y in loader:\n"
    "    for t in y.tolist():\n"
    "        per_class[t] += 1\n"
)


@pytest.mark.parametrize(
    "body",
    [
        # rows walked in key order, through a name
        FILL_FROM_BATCHES + "keys = sorted(per_class)\n"
        "t = torch.tensor([per_class[k] for k in keys])\ndist.all_reduce(t)\n",
        # the values straight
        FILL_FROM_BATCHES + "dist.all_reduce(torch.tensor(list(per_class.values())))\n",
        # sized by the number of keys
        FILL_FROM_BATCHES + "t = torch.zeros(len(per_class))\ndist.all_reduce(t)\n",
        # one collective per key seen
        FILL_FROM_BATCHES + "for k, n in per_class.items():\n"
        "    c = torch.tensor([n])\n    dist.all_reduce(c)\n",
        # a Counter of the labels this rank read, a set of them
        (
            "for x, y in loader:\n    seen = Counter(y.tolist())\n"
            "    dist.all_reduce(torch.tensor(list(seen.values())))\n"
        ),
        (
            "found = set()\nfor batch in loader:\n    for t in batch['label'].tolist():\n"
            "        found.add(t)\nflags = torch.ones(len(found))\ndist.all_reduce(flags)\n"
        ),
    ],
)
def test_rows_or_calls_per_key_the_rank_saw_are_reported(body):
    assert len(lines(body)) == 1


@pytest.mark.parametrize(
    "body",
    [
        # one row per class of the whole set
        (
            "counts = torch.zeros(num_classes)\nfor x, y in loader:\n"
            "    for t in y.tolist():\n        counts[t] += 1\ndist.all_reduce(counts)\n"
        ),
        # the number of keys, or a sum over them, is one value on every rank
        FILL_FROM_BATCHES + "dist.all_reduce(torch.tensor([len(per_class)]))\n",
        FILL_FROM_BATCHES + "dist.all_reduce(torch.tensor(sum(per_class.values())))\n",
        # keys of a fixed list, not of the data
        (
            "per_name = {}\nfor name in NAMES:\n    per_name[name] = 0.0\n"
            "dist.all_reduce(torch.tensor(list(per_name.values())))\n"
        ),
        # a loss dict's names are the model's, the same on every rank
        (
            "losses = {}\nfor k, v in model(torch.ones(1, 4)).items():\n    losses[k] = v\n"
            "dist.all_reduce(torch.stack([losses[k] for k in sorted(losses)]))\n"
        ),
        # entries read by the keys of a fixed list (blind set hn's 08): one row per
        # listed field on every rank, whichever keys the data filled in
        FILL_FROM_BATCHES
        + "dist.all_reduce(torch.tensor([per_class[k] for k in range(num_classes)] + [1.0]))\n",
        # the keys exchanged as objects first
        FILL_FROM_BATCHES + "merged = [None] * 2\ndist.all_gather_object(merged, dict(per_class))\n"
        "dist.all_reduce(torch.tensor(list(per_class.values())))\n",
    ],
)
def test_rows_over_a_fixed_key_set_or_exchanged_keys_are_quiet(body):
    assert lines(body) == []


def test_a_comprehensions_names_and_a_dict_of_loaders_keys_are_no_data_keys():
    # blind sets gw's 13 and 09: containers made in one tuple assignment and filled
    # per task; the task name is also bound by a comprehension over a tensor's values
    # (its own), and a loop over the dict of loaders walks its keys
    body = (
        "full = {n: load(n) for n in NAMES}\n"
        "stats, loaders = {}, {}\n"
        "for n, ds in full.items():\n"
        "    stats[n] = ds.mean()\n"
        "    loaders[n] = make_loader(ds)\n"
        "agg = torch.zeros(len(NAMES))\n"
        "for t in loaders:\n"
        "    agg += model(next(iter(loaders[t])), stats).detach()\n"
        "dist.all_reduce(agg)\n"
        "log = {f'train/{n}': v for n, v in zip(NAMES, agg.tolist())}\n"
    )
    assert lines(body) == []
    # the keys a loader's labels fill in are this rank's own (the check's own case)
    seen = body + (
        "per_label = {}\n"
        "for x, y in loader:\n"
        "    for label in y.tolist():\n"
        "        per_label[label] = per_label.get(label, 0) + 1\n"
        "counts = torch.tensor(list(per_label.values()))\n"
        "dist.all_reduce(counts)\n"
    )
    assert len(lines(seen)) == 1
