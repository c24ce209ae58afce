"""uneven-inputs: a training DataLoader over the items this rank takes (`items[rank::world]`),
each of which holds its own amount of data (assistant/lint/checks/data.py); the torchrun
evidence is the fixture training_on_rank_file_shards_of_uneven_length.py's."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """
import json
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
import numpy as np
"""

EXPANDED = """
class Views(Dataset):
    def __init__(self, root, objs):
        self.items = []
        for k, o in enumerate(objs):
            meta = json.load(open(os.path.join(root, o, "meta.json")))
            for frame in meta["frames"]:
                self.items.append((k, frame))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    all_objs = [line.strip() for line in open("objects.txt")]
    mine = SHARE
    loader = DataLoader(Views("renders", mine), batch_size=4, shuffle=True)
    model = DDP(nn.Linear(4, 4).cuda())
    for batch in loader:
        model(batch).sum().backward()
"""


@pytest.mark.parametrize(
    "share, reported",
    [
        # blind set cr's 13: each object of this rank's share expands into its views
        ("all_objs[rank::world]", [22]),
        ("all_objs", []),  # every rank the same objects
    ],
)
def test_a_dataset_that_expands_each_item_of_the_ranks_share_is_uneven(share, reported):
    body = EXPANDED.replace("SHARE", share)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])] == reported


def test_items_cut_into_windows_by_a_while_loop_are_uneven():
    # blind set id's 10: each recording of this rank's rows cut into windows while
    # they fit, as many as the recording is long
    body = EXPANDED.replace(
        '            for frame in meta["frames"]:\n                self.items.append((k, frame))',
        '            t = 0\n            while t + 4 <= meta["seconds"]:\n'
        "                self.items.append((k, t))\n                t += 4",
    ).replace("SHARE", "all_objs[rank::world]")
    assert "while t + 4" in body
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])] == [24]


PER_SCENE = """
class ScenePairs(Dataset):
    def __init__(self, root, scene):
        self.pairs = json.load(open(os.path.join(root, scene, "pairs.json")))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    scenes = sorted(line.strip() for line in open("scenes.txt"))
    mine = SHARE
    loader = DataLoader(ConcatDataset([ScenePairs("megadepth", s) for s in mine]), batch_size=4)
    model = DDP(nn.Linear(4, 4).cuda())
    for batch in loader:
        model(batch).sum().backward()
"""


@pytest.mark.parametrize(
    "share, reported",
    [
        # blind set hw's 16: a dataset of its own pairs for each scene this rank takes,
        # concatenated: the scenes hold different numbers of pairs
        ("scenes[rank::world]", [18]),
        ("scenes", []),  # every rank the same scenes
    ],
)
def test_a_dataset_built_for_each_item_of_the_ranks_share_is_uneven(share, reported):
    body = PER_SCENE.replace("SHARE", share)
    prelude = PRELUDE.replace(
        "import DataLoader, Dataset", "import ConcatDataset, DataLoader, Dataset"
    )
    assert [line for line, _ in lint_snippet(prelude, body, ["uneven-inputs"])] == reported


FIXED_LENGTH = """
class RandomWindows(Dataset):
    def __init__(self, series, n):
        self.series, self.n = series, n

    def __len__(self):
        return LENGTH

    def __getitem__(self, i):
        return self.series[i % len(self.series)]


def main():
    args = parse_args()  # options: an attribute of them is the run's count
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(os.listdir("parts"))
    series = [torch.load(f) for f in files[rank::world]]
    loader = DataLoader(RandomWindows(series, args.steps * args.batch), batch_size=args.batch)
    model = DDP(nn.Linear(4, 4).cuda())
    for batch in loader:
        model(batch).sum().backward()
"""


@pytest.mark.parametrize(
    "length, reported",
    [
        # blind set cp's 17: windows drawn from the share, as many as the run asks for
        ("self.n", []),
        ("len(self.series)", [19]),  # as many as this rank's share holds
    ],
)
def test_a_dataset_whose_length_the_run_fixes_is_even(length, reported):
    body = FIXED_LENGTH.replace("LENGTH", length)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])] == reported


def test_a_length_given_as_the_shares_size_is_not_fixed_by_the_run():
    body = (
        FIXED_LENGTH.replace("LENGTH", "self.n")
        .replace("RandomWindows(series, args.steps * args.batch)", "RandomWindows(series, n_rows)")
        .replace(
            "    loader = DataLoader(",
            "    n_rows = sum(len(s) for s in series)\n    loader = DataLoader(",
        )
    )
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])] == [20]


HELPER_SHARE = """
def load_my_parts(parts_dir, rank, world, stats):
    files = sorted(glob.glob(os.path.join(parts_dir, "part-*.parquet")))
    mine = files[rank::world]
    rows = torch.cat([torch.load(f) for f in mine])
    return TensorDataset(rows), len(files)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open("stats.json") as f:
        stats = json.load(f)
    train_ds, n_files = load_my_parts("parts", rank, world, stats)
    net = nn.Linear(len(stats["num_cols"]), 4).cuda()
    model = DDP(net)
    loader = DataLoader(train_ds, batch_size=4, shuffle=True)
    for batch in loader:
        model(batch).sum().backward()
"""


def test_a_share_a_file_function_returns_in_a_tuple_is_followed_to_the_loader():
    """Blind set dc's 16: the dataset comes back from a function of the file, beside
    a count, and is read from `files[rank::world]` there."""
    body = HELPER_SHARE.replace(
        '    with open("stats.json") as f:\n        stats = json.load(f)\n',
        '    stats = {"num_cols": ["a", "b"]}\n',
    )
    found = lint_snippet(PRELUDE, body, ["uneven-inputs"])
    assert [line for line, _ in found] == [16]


def test_a_comprehensions_variable_is_not_the_same_name_outside_it():
    """Blind set dc's 16: main's `f` (the stats file) is not the comprehension's `f`
    over this rank's files, so the model built from the stats is the same on every
    rank."""
    found = lint_snippet(PRELUDE, HELPER_SHARE, ["model-differs-across-ranks"])
    assert found == []


SELF_SPLITTING = """
class Stream(torch.utils.data.IterableDataset):
    def __init__(self, keys, rank, world):
        self.keys = keys[rank::world]

    def __iter__(self):
        keys = list(self.keys)
        for key in keys:
            yield from torch.load(key)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = sorted(os.listdir("shards"))
    loader = DataLoader(Stream(keys, rank, world), batch_size=4)
    model = DDP(nn.Linear(4, 4).cuda())
    for batch in loader:
        model(batch).sum().backward()
"""


def test_a_share_a_dataset_class_keeps_in_its_init_is_followed():
    """Blind set bc's 19: the stream keeps `keys[rank::world]` of the files it is
    handed; __iter__'s own `keys` is another name than main's."""
    found = lint_snippet(PRELUDE, SELF_SPLITTING, ["uneven-inputs"])
    assert [line for line, _ in found] == [16]


TWO_FUNCTIONS = """
def read_rows(path):
    with open(path) as f:
        return json.load(f)


def predict(model, rows, rank, world):
    f = rows[rank::world]
    return model(f)


def main():
    dist.init_process_group("nccl")
    rows = read_rows("speakers.json")
    net = nn.Linear(len(rows), 4).cuda()
    model = DDP(net)
"""


def test_a_functions_own_name_is_not_another_functions():
    """Blind set aq's 18: read_rows's `f` (a file) is not predict's `f` (a share)."""
    assert lint_snippet(PRELUDE, TWO_FUNCTIONS, ["model-differs-across-ranks"]) == []


@pytest.mark.parametrize(
    "synced, reported",
    [
        # blind set jo's 19 (correct): each client trained alone, the ranks meet once a round
        ("pass", []),
        ("model = DDP(model)", [32]),  # the same loop under DDP meets at every backward
        ("for p in model.parameters():\n            dist.all_reduce(p.grad)", [33]),
    ],
    ids=["clients trained alone", "under DDP", "gradients all-reduced by hand"],
)
def test_a_share_trained_without_meeting_at_each_step_is_not_uneven(synced, reported):
    body = (
        EXPANDED.split("def main")[0]
        + f"""
def local_steps(model, loader):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in loader:
        model(x).sum().backward()
        {synced}
        opt.step()


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    all_objs = [line.strip() for line in open("objects.txt")]
    model = nn.Linear(4, 4).cuda()
    for rnd in range(100):
        loader = DataLoader(Views("renders", all_objs[rank::world]), batch_size=4, shuffle=True)
        local_steps(model, loader)
        delta = torch.cat([p.detach().flatten() for p in model.parameters()])
        dist.all_reduce(delta)
"""
    )
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])] == reported


@pytest.mark.parametrize(
    ("kept", "reported"),
    [
        # blind set jk's 06: edges partitioned by their head entity
        ("train[train[:, 0] % world == rank]", [6]),
        ("train[np.arange(len(train)) % world == rank]", []),  # by position: even shares
    ],
    ids=["by a key of the data", "by position"],
)
def test_rows_a_key_of_the_data_gives_the_rank_are_uneven(kept, reported):
    body = f"""
def main(train):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    part = torch.from_numpy({kept})
    loader = DataLoader(TensorDataset(part), batch_size=64, shuffle=True)
    model = DDP(nn.Linear(3, 1).cuda())
    for (x,) in loader:
        model(x.float()).sum().backward()
"""
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])] == reported
