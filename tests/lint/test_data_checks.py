"""The checks of assistant/lint/checks/data.py: a DataLoader with no
DistributedSampler in a DDP script (missing-distributed-sampler), and a
shuffling DistributedSampler whose set_epoch is never called while the
script loops over epochs (sampler-set-epoch). Both mistakes are silent, so
the cases where a script handles the data some other way must stay clean."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from snippets import lint_snippet

from assistant.cli import main
from assistant.errors import ExitCode
from assistant.lint import lint_source

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
DATA_CAUSES = {"missing-distributed-sampler", "sampler-set-epoch"}

DDP_PRELUDE = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
model = DDP(torch.nn.Linear(4, 1))
data = TensorDataset(torch.randn(64, 4))
"""

SAMPLER_PRELUDE = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
data = TensorDataset(torch.randn(64, 4))
"""


def findings(prelude: str, body: str) -> list[tuple[str, int]]:
    """(cause id, line in `body`) of the data checks' findings."""
    return [(f.cause_id, line) for line, f in lint_snippet(prelude, body, DATA_CAUSES)]


# ---------------------------------------------------------------- missing-distributed-sampler

NO_SAMPLER_FLAGGED = {
    "shuffled_train_loader": ("loader = DataLoader(data, batch_size=8, shuffle=True)", 1),
    "sampler_given_as_none": ("loader = DataLoader(data, batch_size=8, sampler=None)", 1),
    "dataset_by_keyword": ("loader = DataLoader(dataset=data, batch_size=8)", 1),
    "loader_built_in_a_function": (
        "def make_loader(ds):\n    return DataLoader(ds, batch_size=8)\nloader = make_loader(data)",
        2,
    ),
    "evaluated_on_every_rank": (
        "val = DataLoader(data, batch_size=8)\nfor (x,) in val:\n    model(x)",
        1,
    ),
    "collected_into_memory_and_also_iterated": (
        "loader = DataLoader(data)\ntable = [x for (x,) in loader]\nfor (x,) in loader:\n    model(x)",
        1,
    ),
    "cut_by_the_world_size_of_the_environment": (
        (
            "import os\n"
            "part = Subset(data, range(int(os.environ['WORLD_SIZE'])))\n"
            "loader = DataLoader(part, batch_size=8)"
        ),
        3,
    ),
    "a_copy_of_the_world_size_unpacked_beside_the_rank": (
        (
            "me, world = dist.get_world_size(), dist.get_rank()\n"
            "first = world\nhead = me\nsmall = Subset(data, range(head))\n"
            "part = small\nloader = DataLoader(part, batch_size=8)"
        ),
        6,
    ),
    # blind set et: a table moved to the GPU as it is kept, then trained on whole by every rank
    "moved_into_memory_then_trained_on": (
        (
            "loader = DataLoader(data, batch_size=8)\n"
            "table = [x.cuda() for (x,) in loader]\n"
            "for x in table:\n    model(x).sum().backward()"
        ),
        1,
    ),
    "moved_into_memory_then_handed_to_a_trainer": (
        (
            "def fit(batches):\n    for x in batches:\n        model(x).sum().backward()\n"
            "loader = DataLoader(data, batch_size=8)\n"
            "fit([x.to('cuda') for (x,) in loader])"
        ),
        4,
    ),
    "subclass_of_a_map_dataset": (
        (
            "class Squares(torch.utils.data.Dataset):\n"
            "    def __len__(self):\n        return 10\n"
            "    def __getitem__(self, i):\n        return i * i\n"
            "loader = DataLoader(Squares(), batch_size=2)"
        ),
        6,
    ),
}


@pytest.mark.parametrize("case", sorted(NO_SAMPLER_FLAGGED))
def test_a_loader_every_rank_reads_in_full_is_reported(case: str) -> None:
    body, line = NO_SAMPLER_FLAGGED[case]
    assert findings(DDP_PRELUDE, body) == [("missing-distributed-sampler", line)]


NO_SAMPLER_CLEAN = {
    # a sampler built elsewhere: not known to draw the whole set (torch's RandomSampler
    # is: test_a_whole_set_sampler_is_only_judged_for_replicas_of_a_data_parallel_model)
    "sampler_given": "loader = DataLoader(data, sampler=samplers.build(data, cfg))",
    # read once into memory, for a sampler of the file's own (few-shot episodes)
    "collected_into_memory": "loader = DataLoader(data, batch_size=256)\ntable = [x for (x,) in loader]",
    # blind set et's 03 and 06: the same images on every rank for a BatchNorm recalibration
    "moved_into_memory": (
        "loader = DataLoader(data, batch_size=256)\n"
        "calib = [x.to('cuda', non_blocking=True) for (x,) in loader]\n"
        "def recalibrate(net, batches):\n    for x in batches:\n        net(x)\n"
        "recalibrate(model, calib)"
    ),
    "listed": "batches = list(DataLoader(data, batch_size=8))",
    "batch_sampler_given": "loader = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])",
    "sampler_by_position": "loader = DataLoader(data, 8, False, my_sampler)",
    "options_splatted": "loader = DataLoader(data, **loader_options)",
    "built_on_rank_zero": "if rank == 0:\n    loader = DataLoader(data, batch_size=8)",
    "built_after_an_early_return": (
        "def report():\n    if dist.get_rank() != 0:\n        return\n"
        "    for (x,) in DataLoader(data, batch_size=8):\n        print(model.module(x))\n"
        "report()"
    ),
    "only_rank_zero_reads_it": (
        "test_loader = DataLoader(data, batch_size=8)\n"
        "def evaluate(loader):\n    for (x,) in loader:\n        model.module(x)\n"
        "if rank == 0:\n    evaluate(test_loader)"
    ),
    "subset_cut_by_rank": (
        "mine = Subset(data, range(rank, len(data), world_size))\n"
        "loader = DataLoader(mine, batch_size=8)"
    ),
    "indices_cut_by_rank_two_assignments_back": (
        "indices = list(range(len(data)))[rank::world_size]\n"
        "mine = Subset(data, indices)\n"
        "loader = DataLoader(mine, batch_size=8)"
    ),
    "iterable_dataset_of_the_script": (
        "class Stream(IterableDataset):\n"
        "    def __iter__(self):\n        yield from range(dist.get_rank(), 100, 2)\n"
        "class Tokens(Stream):\n    pass\n"
        "def open_stream():\n    return Tokens()\n"
        "stream = open_stream()\n"
        "loader = DataLoader(stream, batch_size=8)\n"
        "direct = DataLoader(Stream(), batch_size=8)"
    ),
    "streaming_dataset": (
        "import datasets\n"
        "stream = datasets.load_dataset('c4', split='train', streaming=True)\n"
        "loader = DataLoader(stream, batch_size=8)"
    ),
    "accelerate_prepares_it": (
        "from accelerate import Accelerator\n"
        "accelerator = Accelerator()\n"
        "loader = DataLoader(data, batch_size=8, shuffle=True)\n"
        "model, loader = accelerator.prepare(model, loader)"
    ),
    "split_by_node_with_the_rank_of_the_environment": (
        "import os\nfrom datasets.distributed import split_dataset_by_node\n"
        "mine = split_dataset_by_node(\n"
        "    data, rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']))\n"
        "loader = DataLoader(mine, batch_size=8)"
    ),
    "shard_index_of_the_local_rank_variable": (
        "import os\n"
        "local = int(os.environ.get('LOCAL_RANK', 0))\nworld = int(os.environ['WORLD_SIZE'])\n"
        "shards = data.shard(num_shards=world, index=local)\n"
        "loader = DataLoader(shards, batch_size=8)"
    ),
    "shard_index_of_getenv_inline": (
        "from os import getenv\n"
        "loader = DataLoader(data.shard(num_shards=2, index=int(getenv('RANK'))), batch_size=8)"
    ),
    "get_rank_stored_under_another_name_four_assignments_back": (
        "me = dist.get_rank()\nmine = me\n"
        "indices = list(range(len(data)))\nmy_indices = indices[mine::world_size]\n"
        "train = Subset(data, my_indices)\nds = train\n"
        "loader = DataLoader(ds, batch_size=8)"
    ),
    "get_rank_unpacked_under_another_name": (
        "me, world = dist.get_rank(), dist.get_world_size()\n"
        "part = list(range(len(data)))[me::world]\nsubset = Subset(data, part)\n"
        "train = subset\nloader = DataLoader(train, batch_size=8)"
    ),
    "distributed_sampler_elsewhere_in_the_script": (
        "from torch.utils.data.distributed import DistributedSampler\n"
        "train = DataLoader(data, sampler=DistributedSampler(data))\n"
        "extra = DataLoader(data, batch_size=8)"
    ),
}


CALLER_CUT = """
def validate(net, val_ds):
    for batch in DataLoader(val_ds, batch_size=1):
        net(batch)


def run_fold(net, cases):
    part = CASES
    validate(net, TensorDataset(part))
"""


@pytest.mark.parametrize(
    ("cases", "reported"),
    [
        # blind set fu's 17: the caller hands the helper its rank's partition of the cases
        ("cases[rank::world_size]", []),
        ("cases", [("missing-distributed-sampler", 3)]),
    ],
    ids=["rank-share", "whole"],
)
def test_a_loader_over_a_parameter_is_cut_as_the_callers_argument(cases, reported) -> None:
    assert findings(DDP_PRELUDE, CALLER_CUT.replace("CASES", cases)) == reported


HELPER_WRAPS = """
from torch.distributed.fsdp import fully_shard


def build():
    net = torch.nn.Linear(4, 1)
    WRAP
    return net


def main():
    policy = build()
    loader = DataLoader(data, batch_size=8, shuffle=True)
    opt = torch.optim.AdamW(policy.parameters())
    for (x,) in loader:
        policy(x).sum().backward()
        opt.step()
"""


@pytest.mark.parametrize(
    ("wrap", "reported"),
    [
        # blind set fx's 17: the model a helper shards trains together; its loader is unsplit
        ("fully_shard(net)", [("missing-distributed-sampler", 13)]),
        # a helper that wraps nothing: each rank trains its own model on all the data
        ("pass", []),
    ],
    ids=["helper-shards", "own-model"],
)
def test_a_model_a_helper_wraps_trains_together(wrap, reported) -> None:
    assert findings(DDP_PRELUDE, HELPER_WRAPS.replace("WRAP", wrap)) == reported


@pytest.mark.parametrize("case", sorted(NO_SAMPLER_CLEAN))
def test_a_loader_the_script_splits_otherwise_is_not_reported(case: str) -> None:
    assert findings(DDP_PRELUDE, NO_SAMPLER_CLEAN[case]) == []


def test_a_lightning_module_gets_its_sampler_from_the_trainer() -> None:
    source = (
        "import lightning as L\nimport torch\nimport torch.distributed as dist\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "class Model(L.LightningModule):\n"
        "    def train_dataloader(self):\n"
        "        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)\n"
        "dist.init_process_group('gloo')\n"
        "L.Trainer(strategy='ddp', devices=2).fit(Model())\n"
    )
    assert lint_source(source) == []


def test_a_script_that_is_not_distributed_is_not_reported() -> None:
    source = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2, shuffle=True)\n"
        "for epoch in range(2):\n    for batch in loader:\n        pass\n"
    )
    assert lint_source(source) == []


def test_the_message_names_the_dataset_and_the_fix() -> None:
    (finding,) = [
        f
        for f in lint_source(DDP_PRELUDE + "loader = DataLoader(data, batch_size=8)\n")
        if f.cause_id == "missing-distributed-sampler"
    ]
    assert "DataLoader over data has no sampler" in finding.message
    assert "every rank iterates the whole dataset" in finding.message
    assert finding.message.endswith("pass sampler=DistributedSampler(data)")
    assert "\n" not in finding.message


# ---------------------------------------------------------------- sampler-set-epoch

SET_EPOCH_FLAGGED = {
    "loop_over_the_loader": (
        (
            "sampler = DistributedSampler(data, shuffle=True)\n"
            "loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
            "for epoch in range(3):\n    for (x,) in loader:\n        model(x)"
        ),
        1,
    ),
    "loader_handed_to_an_epoch_function": (
        (
            "def train_one_epoch(loader):\n    for (x,) in loader:\n        model(x)\n"
            "sampler = DistributedSampler(data)\n"
            "loader = DataLoader(data, sampler=sampler)\n"
            "for epoch in range(3):\n    train_one_epoch(loader)"
        ),
        4,
    ),
    "while_loop_over_steps": (
        (
            "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
            "step = 0\n"
            "while step < 100:\n    for (x,) in loader:\n        step += 1"
        ),
        1,
    ),
    "loader_returned_by_a_builder": (
        (
            "def build():\n"
            "    sampler = DistributedSampler(data)\n"
            "    return DataLoader(data, batch_size=8, sampler=sampler)\n"
            "train_loader = build()\n"
            "for epoch in range(3):\n    for (x,) in train_loader:\n        model(x)"
        ),
        2,
    ),
}


# The sampler built inside the epoch loop, fed to this loader and walked there.
REBUILT = (
    "    loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
    "    for (x,) in loader:\n        model(x)\n"
)

SET_EPOCH_FLAGGED.update(
    {
        "rebuilt_each_epoch_with_a_fixed_seed": (
            "for epoch in range(3):\n    sampler = DistributedSampler(data, seed=42)\n" + REBUILT,
            2,
        ),
        "rebuilt_each_epoch_with_the_default_seed": (
            "for epoch in range(3):\n    sampler = DistributedSampler(data)\n" + REBUILT,
            2,
        ),
        "seeded_by_the_epoch_variable_but_built_once_before_the_loop": (
            (
                "epoch = 0\nsampler = DistributedSampler(data, seed=epoch)\n"
                "loader = DataLoader(data, sampler=sampler)\n"
                "for epoch in range(3):\n    for (x,) in loader:\n        model(x)"
            ),
            2,
        ),
        "seeded_by_a_run_loop_around_the_epochs": (
            (
                "for run in range(2):\n    sampler = DistributedSampler(data, seed=run)\n"
                "    loader = DataLoader(data, sampler=sampler)\n"
                "    for epoch in range(3):\n        for (x,) in loader:\n            model(x)"
            ),
            2,
        ),
        "rebuilt_each_epoch_with_the_seed_of_the_run": (
            (
                "for run in range(2):\n    for epoch in range(3):\n"
                "        sampler = DistributedSampler(data, seed=run)\n"
                "        loader = DataLoader(data, sampler=sampler)\n"
                "        for (x,) in loader:\n            model(x)"
            ),
            3,
        ),
        "reseeded_in_a_loop_then_walked_by_another": (
            (
                "for i in range(3):\n    sampler = DistributedSampler(data, seed=i)\n"
                "    loader = DataLoader(data, sampler=sampler)\n"
                "for epoch in range(3):\n    for (x,) in loader:\n        model(x)"
            ),
            2,
        ),
        # blind set ep's 03: the loader takes a batch sampler built over the DistributedSampler
        "fed_through_a_batch_sampler": (
            (
                "sampler = DistributedSampler(data)\n"
                "batches = torch.utils.data.BatchSampler(sampler, 8, drop_last=True)\n"
                "loader = DataLoader(data, batch_sampler=batches)\n"
                "for epoch in range(3):\n    for (x,) in loader:\n        model(x)"
            ),
            1,
        ),
        # blind set eq's 05: the passes run in the file's endless generator over the loader
        "walked_pass_after_pass_by_the_files_cycle": (
            (
                "def cycle(batches):\n    while True:\n        for batch in batches:\n"
                "            yield batch\n"
                "sampler = DistributedSampler(data)\n"
                "loader = DataLoader(data, sampler=sampler)\n"
                "stream = cycle(loader)\n"
                "for step in range(100):\n    (x,) = next(stream)\n    model(x)"
            ),
            5,
        ),
        "generator_seeded_once_outside": (
            "g = torch.Generator()\ng.manual_seed(0)\nseed = int(torch.randint(9, (1,), generator=g))\n"
            "for epoch in range(3):\n    sampler = DistributedSampler(data, seed=seed)\n" + REBUILT,
            5,
        ),
    }
)


# set_epoch called once, before the epoch loop (on resuming): every epoch keeps its seed.
SET_EPOCH_FLAGGED.update(
    {
        "called_once_before_the_loop": (
            (
                "sampler = DistributedSampler(data)\nloader = DataLoader(data, sampler=sampler)\n"
                "sampler.set_epoch(start_epoch)\n"
                "for epoch in range(start_epoch, 3):\n    for (x,) in loader:\n        model(x)"
            ),
            3,
        ),
        # the epoch a parameter, but the loop counts the epochs from it: set once
        "called_once_with_the_start_epoch_parameter": (
            (
                "def train(start_epoch):\n"
                "    loader = DataLoader(data, sampler=DistributedSampler(data))\n"
                "    loader.sampler.set_epoch(start_epoch)\n"
                "    for epoch in range(start_epoch, 3):\n        for (x,) in loader:\n"
                "            model(x)"
            ),
            3,
        ),
        "called_once_through_the_loader_in_main": (
            (
                "def main():\n    loader = DataLoader(data, sampler=DistributedSampler(data))\n"
                "    loader.sampler.set_epoch(0)\n"
                "    for epoch in range(3):\n        for (x,) in loader:\n            model(x)"
            ),
            3,
        ),
    }
)
# blind set gw's 19: one loader per task, kept in a dict by key, each pass restarted
# with iter(loaders[t]): no sampler is told the epoch
SET_EPOCH_FLAGGED["samplers_of_loaders_kept_by_key"] = (
    (
        "loaders = {}\n"
        "for t in ('a', 'b'):\n"
        "    sampler = DistributedSampler(data)\n"
        "    loaders[t] = DataLoader(data, sampler=sampler)\n"
        "for epoch in range(3):\n"
        "    its = {t: iter(loaders[t]) for t in ('a', 'b')}\n"
        "    for step in range(4):\n"
        "        model(next(its['a'])[0])"
    ),
    3,
)
SET_EPOCH_ONCE_CLEAN = {
    # before the loop and again inside it
    "also_inside_the_loop": (
        "sampler = DistributedSampler(data)\nloader = DataLoader(data, sampler=sampler)\n"
        "sampler.set_epoch(0)\nfor epoch in range(3):\n    sampler.set_epoch(epoch)\n"
        "    for (x,) in loader:\n        model(x)"
    ),
    # in the function the loop runs each epoch
    "in_the_epoch_function": (
        "def train_one_epoch(loader, epoch):\n    loader.sampler.set_epoch(epoch)\n"
        "    for (x,) in loader:\n        model(x)\n"
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        "for epoch in range(3):\n    train_one_epoch(loader, epoch)"
    ),
    # blind set af's 03: the epoch function repeats the loader a few times per epoch
    "epoch_function_repeating_the_loader": (
        "class Trainer:\n    def __init__(self):\n"
        "        self.sampler = DistributedSampler(data)\n"
        "        self.loader = DataLoader(data, sampler=self.sampler)\n"
        "    def train_epoch(self, epoch):\n        self.sampler.set_epoch(epoch)\n"
        "        for _ in range(4):\n            for (x,) in self.loader:\n                model(x)\n"
        "    def run(self):\n        for epoch in range(3):\n            self.train_epoch(epoch)"
    ),
}


@pytest.mark.parametrize("case", sorted(SET_EPOCH_ONCE_CLEAN))
def test_set_epoch_that_runs_each_epoch_is_not_reported(case: str) -> None:
    assert findings(SAMPLER_PRELUDE, SET_EPOCH_ONCE_CLEAN[case]) == []


@pytest.mark.parametrize("case", sorted(SET_EPOCH_FLAGGED))
def test_a_sampler_never_told_the_epoch_is_reported(case: str) -> None:
    body, line = SET_EPOCH_FLAGGED[case]
    assert findings(SAMPLER_PRELUDE, body) == [("sampler-set-epoch", line)]


SET_EPOCH_CLEAN = {
    "set_epoch_called": (
        "sampler = DistributedSampler(data)\nloader = DataLoader(data, sampler=sampler)\n"
        "for epoch in range(3):\n    sampler.set_epoch(epoch)\n    for (x,) in loader:\n"
        "        model(x)"
    ),
    "set_epoch_through_the_loader": (
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        "for epoch in range(3):\n    loader.sampler.set_epoch(epoch)\n"
        "    for (x,) in loader:\n        model(x)"
    ),
    "set_epoch_on_a_sampler_a_call_returns": (
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        "for epoch in range(3):\n    sampler_of(loader).set_epoch(epoch)\n"
        "    for (x,) in loader:\n        model(x)"
    ),
    "set_epoch_in_the_files_cycle": (
        "def cycle(loader, sampler):\n    epoch = 0\n    while True:\n"
        "        sampler.set_epoch(epoch)\n        for batch in loader:\n"
        "            yield batch\n        epoch += 1\n"
        "sampler = DistributedSampler(data)\nloader = DataLoader(data, sampler=sampler)\n"
        "batches = cycle(loader, sampler)\n"
        "for step in range(100):\n    (x,) = next(batches)\n    model(x)"
    ),
    "set_epoch_by_a_helper_function": (
        "from helpers import set_epoch\n"
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        "for epoch in range(3):\n    set_epoch(loader, epoch)\n"
        "    for (x,) in loader:\n        model(x)"
    ),
    "no_shuffle": (
        "sampler = DistributedSampler(data, shuffle=False)\n"
        "loader = DataLoader(data, sampler=sampler)\n"
        "for epoch in range(3):\n    for (x,) in loader:\n        model(x)"
    ),
    "one_pass_only": (
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        "for (x,) in loader:\n    model(x)"
    ),
    "one_pass_that_also_measures_the_loader": (
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        "for i, (x,) in enumerate(loader):\n    model(x)\n    print(i, len(loader))"
    ),
    "epoch_loop_over_another_loader": (
        "once = DataLoader(data, sampler=DistributedSampler(data))\n"
        "other = DataLoader(data, batch_size=8)\n"
        "for epoch in range(3):\n    for (x,) in other:\n        model(x)\n"
        "for (x,) in once:\n    model(x)"
    ),
}


SET_EPOCH_CLEAN.update(
    {
        "rebuilt_each_epoch_with_the_epoch_as_seed": (
            "for epoch in range(3):\n    sampler = DistributedSampler(data, seed=epoch)\n" + REBUILT
        ),
        "rebuilt_each_epoch_with_base_seed_plus_epoch": (
            "base_seed = 42\nfor epoch in range(3):\n"
            "    sampler = DistributedSampler(data, shuffle=True, seed=base_seed + epoch)\n"
            + REBUILT
        ),
        "seed_given_by_position": (
            "for epoch in range(3):\n"
            "    sampler = DistributedSampler(data, 2, dist.get_rank(), True, 100 + epoch)\n"
            + REBUILT
        ),
        "seed_worked_out_first": (
            "for epoch in range(3):\n    seed = 1000 * epoch + 7\n"
            "    sampler = DistributedSampler(data, seed=seed)\n" + REBUILT
        ),
        "seed_drawn_from_a_generator_seeded_by_the_epoch": (
            "for epoch in range(3):\n    g = torch.Generator()\n    g.manual_seed(epoch)\n"
            "    seed = int(torch.randint(2**31, (1,), generator=g))\n"
            "    sampler = DistributedSampler(data, seed=seed)\n" + REBUILT
        ),
        "seed_drawn_from_a_generator_built_with_the_epoch": (
            "import numpy as np\nfor epoch in range(3):\n"
            "    rng = np.random.default_rng(epoch)\n"
            "    sampler = DistributedSampler(data, seed=int(rng.integers(2**31)))\n" + REBUILT
        ),
        "rebuilt_each_epoch_and_handed_to_an_epoch_function": (
            "def train_one_epoch(loader):\n    for (x,) in loader:\n        model(x)\n"
            "for i, epoch in enumerate(range(3)):\n"
            "    sampler = DistributedSampler(data, seed=epoch)\n"
            "    train_one_epoch(DataLoader(data, sampler=sampler))\n"
            "    loader = DataLoader(data, sampler=sampler)\n    train_one_epoch(loader)"
        ),
    }
)


@pytest.mark.parametrize("case", sorted(SET_EPOCH_CLEAN))
def test_a_sampler_that_needs_no_epoch_or_gets_one_is_not_reported(case: str) -> None:
    assert findings(SAMPLER_PRELUDE, SET_EPOCH_CLEAN[case]) == []


def test_the_loop_named_is_the_one_of_the_samplers_own_class() -> None:
    # Both the class and main call their loader `loader`; each sampler gets its own loop.
    body = (
        "class Trainer:\n"
        "    def __init__(self):\n"
        "        self.sampler = DistributedSampler(data)\n"
        "        self.loader = DataLoader(data, sampler=self.sampler)\n"
        "    def epoch(self):\n"
        "        for (x,) in self.loader:\n            model(x)\n"
        "    def fit(self):\n"
        "        for epoch in range(3):\n            self.epoch()\n"
        "sampler = DistributedSampler(data)\n"
        "loader = DataLoader(data, sampler=sampler)\n"
        "for epoch in range(3):\n    for (x,) in loader:\n        model(x)\n"
    )
    found = [f for f in lint_source(SAMPLER_PRELUDE + body) if f.cause_id == "sampler-set-epoch"]
    offset = SAMPLER_PRELUDE.count("\n")
    assert [(f.line - offset) for f in found] == [3, 11]
    assert "the loop on line" in found[0].message
    assert f"line {offset + 9} runs the epochs" in found[0].message
    assert f"line {offset + 13} runs the epochs" in found[1].message


# ---------------------------------------------------------------- the fixtures, end to end


def test_cli_lint_reports_the_loaders_without_a_sampler() -> None:
    path = SCRIPTS / "dataloader_without_distributed_sampler.py"
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == ExitCode.FAILED
    assert f"{path}:21: [missing-distributed-sampler]" in result.stdout
    assert f"{path}:22: [missing-distributed-sampler]" in result.stdout
    assert result.stdout.strip().endswith("2 finding(s)")


def test_cli_lint_reports_the_sampler_never_told_the_epoch() -> None:
    path = SCRIPTS / "sampler_set_epoch_never_called.py"
    result = CliRunner().invoke(main, ["lint", str(path)])
    assert result.exit_code == ExitCode.FAILED
    assert f"{path}:18: [sampler-set-epoch]" in result.stdout
    assert "the loop on line 34 runs the epochs" in result.stdout
    assert result.stdout.strip().endswith("1 finding(s)")


@pytest.mark.parametrize(
    "name",
    [
        "correct_dataloader_with_distributed_sampler.py",
        "correct_iterable_dataset_split_by_rank.py",
        "correct_sampler_reseeded_each_epoch.py",
        "correct_dataset_sharded_by_env_rank.py",
    ],
)
def test_cli_lint_of_the_fixed_scripts_is_clean(name: str) -> None:
    result = CliRunner().invoke(main, ["lint", str(SCRIPTS / name)])
    assert result.exit_code == ExitCode.OK, result.output
    assert result.stdout.strip().endswith("0 finding(s)")


def test_cli_lint_json_carries_cause_line_and_message() -> None:
    path = SCRIPTS / "sampler_set_epoch_never_called.py"
    result = CliRunner().invoke(main, ["lint", "--json", str(path)])
    assert result.exit_code == ExitCode.FAILED
    (finding,) = json.loads(result.stdout)
    assert (finding["cause_id"], finding["line"]) == ("sampler-set-epoch", 18)
    assert "set_epoch is never called" in finding["message"]


def test_deeply_nested_loops_are_walked_once_for_the_epoch_loop(monkeypatch) -> None:
    # Each node counts once, for the innermost loop around it, not once per loop around it:
    # 60 nested loops over a body of 300 calls stay linear in the file.
    from assistant.lint.checks import data as checks

    looked_at = []
    walks_of = checks.DataFlow.walks_of
    monkeypatch.setattr(
        checks.DataFlow, "walks_of", lambda self, node: looked_at.append(1) or walks_of(self, node)
    )
    loops = "".join(" " * i + f"for e{i} in range(2):\n" for i in range(60))
    body = "".join(" " * 61 + f"model(x + {i})\n" for i in range(300))
    source = (
        SAMPLER_PRELUDE
        + "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        + loops
        + " " * 60
        + "for (x,) in loader:\n"
        + body
    )
    offset = SAMPLER_PRELUDE.count("\n")
    found = [(f.cause_id, f.line - offset) for f in lint_source(source)]
    assert found == [("sampler-set-epoch", 1)]
    assert len(looked_at) <= len(list(ast.walk(ast.parse(source))))


def test_many_reads_in_one_statement_judge_it_once(monkeypatch) -> None:
    # 300 reads of the loader inside one loop on rank 0: the loop is judged once, not per read.
    from assistant.lint.checks import data as checks

    judged = []
    judge = checks.DataFlow.statement_on_rank_zero
    monkeypatch.setattr(
        checks.DataFlow,
        "statement_on_rank_zero",
        lambda self, statement: judged.append(statement) or judge(self, statement),
    )
    reads = "        last = loader\n        model(x)\n" * 300
    body = "loader = DataLoader(data, batch_size=8)\nif rank == 0:\n    for (x,) in data:\n" + reads
    assert findings(DDP_PRELUDE, body) == []
    assert len(judged) == 1


@pytest.mark.parametrize(
    "inner",
    [
        "for (x,) in loader:\n            model(x)",  # the inner loop walks it itself
        "train_step()",  # or calls a function that does
    ],
)
def test_the_epoch_loop_is_found_around_a_loop_that_walks_the_loader(inner: str) -> None:
    body = (
        "def train_step():\n    for (x,) in loader:\n        model(x)\n"
        "loader = DataLoader(data, sampler=DistributedSampler(data))\n"
        f"for epoch in range(3):\n    for repeat in range(2):\n        {inner}\n"
    )
    found = [f for f in lint_source(SAMPLER_PRELUDE + body) if f.cause_id == "sampler-set-epoch"]
    offset = SAMPLER_PRELUDE.count("\n")
    assert [f.line - offset for f in found] == [4]
    assert f"the loop on line {offset + 5} runs the epochs" in found[0].message


def test_a_value_many_loaders_read_is_looked_into_once(monkeypatch) -> None:
    # 100 loaders over one dataset built by 51 calls: each call is asked once, not per loader.
    from assistant.lint.checks import data as checks

    asked = []
    builds = checks.DataFlow.builds_iterable
    monkeypatch.setattr(
        checks.DataFlow, "builds_iterable", lambda self, call: asked.append(1) or builds(self, call)
    )
    value = "f(" + ", ".join(f"g({i})" for i in range(50)) + ")"
    body = f"shared = {value}\n" + "DataLoader(shared, batch_size=8)\n" * 100
    assert len(findings(DDP_PRELUDE, body)) == 100
    assert len(asked) <= 51


def test_many_samplers_and_epoch_loops_place_each_once(monkeypatch) -> None:
    # 200 samplers fed to `loader`, 200 loops walking it: each node's class or function
    # is looked up once, not once per sampler and loop.
    from assistant.lint.checks import data as checks

    placed = []
    home = checks.DataFlow.home
    monkeypatch.setattr(
        checks.DataFlow, "home", lambda self, node: placed.append(1) or home(self, node)
    )
    samplers = "s = DistributedSampler(data)\nloader = DataLoader(data, sampler=s)\n" * 200
    loops = "for e in range(2):\n    f(loader)\n" * 200
    assert len(findings(SAMPLER_PRELUDE, samplers + loops)) == 200
    assert len(placed) <= 400


def test_loaders_a_builder_returns_look_up_its_callers_once(monkeypatch) -> None:
    # 100 loaders returned by one builder that 100 statements call: its callers' names
    # are looked up once for the builder, not once per loader.
    from assistant.lint.checks import data as checks

    looked_up = []
    bound = checks.DataFlow.names_bound_to
    monkeypatch.setattr(
        checks.DataFlow,
        "names_bound_to",
        lambda self, call: looked_up.append(1) or bound(self, call),
    )
    loaders = "DataLoader(data, sampler=sampler),\n" * 100
    body = (
        "sampler = DistributedSampler(data)\n"
        f"def build():\n    return (\n{loaders})\n" + "loader = build()\n" * 100
    ) + "for epoch in range(3):\n    for (x,) in loader:\n        model(x)\n"
    assert findings(SAMPLER_PRELUDE, body) == [("sampler-set-epoch", 1)]
    assert len(looked_up) <= 1000


def test_a_statement_many_loaders_are_read_in_is_judged_once(monkeypatch) -> None:
    # 50 loaders read in one loop of 50 calls on rank 0: the loop's calls are placed once.
    from assistant.lint.checks import data as checks

    placed = []
    only_some = checks.DataFlow.only_some_ranks
    monkeypatch.setattr(
        checks.DataFlow,
        "only_some_ranks",
        lambda self, call: placed.append(1) or only_some(self, call),
    )
    loaders = "".join(f"loader{i} = DataLoader(data, batch_size=8)\n" for i in range(50))
    reads = "".join(f"        last = loader{i}\n        model(x)\n" for i in range(50))
    body = loaders + "if rank == 0:\n    for (x,) in data:\n" + reads
    assert findings(DDP_PRELUDE, body) == []
    assert len(placed) <= 200


def test_many_samplers_rebuilt_in_one_epoch_loop_count_its_walks_once(monkeypatch) -> None:
    # 300 samplers rebuilt with the epoch's seed, then 300 more loops over `loader` in the
    # same function: each loop's function is looked up once, not once per sampler.
    from assistant.lint.checks import data as checks

    placed = []
    home = checks.DataFlow.home
    monkeypatch.setattr(
        checks.DataFlow, "home", lambda self, node: placed.append(1) or home(self, node)
    )
    rebuilt = (
        "        s = DistributedSampler(data, seed=epoch)\n"
        "        loader = DataLoader(data, sampler=s)\n"
    )
    epochs = "def main():\n    for epoch in range(3):\n" + rebuilt * 300 + "        f(loader)\n"
    again = "    for again in range(2):\n        f(loader)\n" * 300
    assert findings(SAMPLER_PRELUDE, epochs) == []
    placed.clear()
    assert len(findings(SAMPLER_PRELUDE, epochs + again)) == 300  # walked again each time
    assert len(placed) <= 4 * 300  # twice per sampler, once per loop; not per sampler and loop


def test_a_long_chain_of_copies_of_the_rank_is_followed_once(monkeypatch) -> None:
    # r0 = dist.get_rank(), r1 = r0, ... r3000: the rank held under each name, each
    # assignment looked at once, and the dataset cut by the last one is sharded.
    from assistant.lint.checks import data as checks

    asked = []
    is_rank = checks.is_rank_expr
    monkeypatch.setattr(
        checks, "is_rank_expr", lambda expr, script: asked.append(1) or is_rank(expr, script)
    )
    copies = "r0 = dist.get_rank()\n" + "".join(f"r{i + 1} = r{i}\n" for i in range(3000))
    body = copies + "loader = DataLoader(Subset(data, range(r3000, 64, 2)), batch_size=8)\n"
    assert findings(DDP_PRELUDE, body) == []
    assert len(asked) <= 2 * len(list(ast.walk(ast.parse(DDP_PRELUDE + body))))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "printed"),
    [
        # Each rank asserts that no epoch repeated another's order.
        ("correct_sampler_reseeded_each_epoch.py", "3 epochs, 3 orders"),
        # Each rank asserts that the shards split the training set.
        ("correct_dataset_sharded_by_env_rank.py", "read 64 of 128"),
    ],
)
def test_the_fixtures_lint_quiet_on_run_correctly_under_torchrun(
    name: str, printed: str, torchrun
) -> None:
    result = torchrun(SCRIPTS / name)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(printed) == 2


# ---------------------------------------------------------------- a sampler of the file's own

OWN_SAMPLER = """
from torch.utils.data import Sampler


class BucketSampler(Sampler):
    def __init__(self, lengths, seed=0):
        self.lengths, self.seed = lengths, seed

    def __iter__(self):
        return iter(sorted(range(len(self.lengths)), key=self.lengths.__getitem__))

    def __len__(self):
        return len(self.lengths)
"""


def both_ranks_print(torchrun, *expected: tuple[str, str]) -> None:
    """Each (fixture, line): the fixture runs to its end on two ranks, each printing
    `line`. The fixtures are launched at once (`torchrun.start`)."""
    waits = [(torchrun.start(SCRIPTS / script), line) for script, line in expected]
    for wait, line in waits:
        ran = wait()
        assert ran.returncode == 0, ran.stderr[-2000:]
        assert ran.stdout.count(line) == 2, ran.stdout


@pytest.mark.slow
def test_an_own_sampler_that_never_splits_reads_everything_on_every_rank(torchrun):
    both_ranks_print(
        torchrun,
        ("own_sampler_not_split_by_rank.py", "read 128 of 128"),
        ("correct_own_sampler_split_by_rank.py", "read 64 of 128"),
    )


@pytest.mark.slow
def test_a_weighted_sampler_draws_a_full_epoch_on_every_rank_and_the_twin_a_share(torchrun):
    both_ranks_print(
        torchrun,
        ("weighted_sampler_draws_a_full_epoch_per_rank.py", "drew 128 of 128"),
        ("correct_weighted_sampler_per_rank_share.py", "drew 64 of 128"),
    )


@pytest.mark.slow
def test_set_epoch_once_before_the_loop_replays_one_order_and_the_twin_does_not(torchrun):
    both_ranks_print(
        torchrun,
        ("sampler_set_epoch_once_before_the_loop.py", "one order for every epoch: True"),
        ("correct_sampler_set_epoch_each_epoch.py", "one order for every epoch: False"),
    )


def test_a_whole_set_sampler_is_only_judged_for_replicas_of_a_data_parallel_model():
    """Pipeline stages read the same batches: with no DDP / FSDP wrapper a
    RandomSampler on every rank is no mistake."""
    stages = DDP_PRELUDE.replace("model = DDP(torch.nn.Linear(4, 1))\n", "")
    body = (
        "from torch.utils.data import RandomSampler\n"
        "loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data))\n"
    )
    assert findings(stages, body) == []
    assert findings(DDP_PRELUDE, body) == [("missing-distributed-sampler", 2)]


def test_a_weighted_sampler_given_a_generator_seeded_with_the_rank_draws_its_own_share():
    # blind set au 20: each rank draws its own iters * batch samples with replacement
    body = (
        "from torch.utils.data import WeightedRandomSampler\n"
        "g = torch.Generator().manual_seed(7 + dist.get_rank())\n"
        "sampler = WeightedRandomSampler(w, num_samples=1000, replacement=True, generator=g)\n"
        "loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
    )
    assert findings(DDP_PRELUDE, body) == []
    common = body.replace("7 + dist.get_rank()", "7")
    assert [cause for cause, _line in findings(DDP_PRELUDE, common)] == [
        "missing-distributed-sampler"
    ]


@pytest.mark.parametrize(
    "test, reported",
    [
        # blind set cv's 18: an option picks the weighted sampler, drawn on every rank
        ("args.weighted_sample", True),
        ("not args.uniform", True),
        # the single-process run's sampler beside the distributed one
        ("not args.distributed", False),
        ("world_size == 1", False),
        ("args.local_rank == -1", False),
    ],
)
def test_a_whole_set_sampler_an_option_picks_beside_a_distributed_one(test, reported):
    body = (
        "from torch.utils.data import WeightedRandomSampler\n"
        f"if {test}:\n"
        "    sampler = WeightedRandomSampler(w, num_samples=len(data))\n"
        "else:\n"
        "    sampler = DistributedSampler(data)\n"
        "loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
    )
    found = [cause for cause, _line in findings(DDP_PRELUDE, body)]
    assert found == (["missing-distributed-sampler"] if reported else []), found


def test_an_own_sampler_is_reported_as_sampler_or_batch_sampler_directly_or_by_name():
    body = OWN_SAMPLER + (
        "sampler = BucketSampler([3, 1, 2])\n"
        "loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
        "batches = DataLoader(data, batch_sampler=BucketSampler([1, 2]))\n"
    )
    last = len(body.splitlines())
    assert findings(DDP_PRELUDE, body) == [
        ("missing-distributed-sampler", last - 1),
        ("missing-distributed-sampler", last),
    ]


@pytest.mark.parametrize(
    "built",
    [
        "BucketSampler([3, 1, 2], rank=rank)",  # told the rank where it is built
        "BucketSampler(lengths_of_this_shard)",  # a name that says it is this rank's part
        "DistributedSamplerWrapper(BucketSampler([3, 1]))",  # wrapped by a splitting sampler
        "make_sampler([3, 1, 2])",  # built elsewhere: not known
    ],
)
def test_an_own_sampler_told_the_rank_or_not_known_is_quiet(built: str):
    body = OWN_SAMPLER + f"loader = DataLoader(data, batch_size=8, sampler={built})\n"
    assert findings(DDP_PRELUDE, body) == []


def test_an_own_sampler_whose_code_reads_the_rank_is_quiet():
    splitting = OWN_SAMPLER.replace(
        "return iter(sorted(", "return iter(sorted(range(dist.get_rank(), 9, 2)) or sorted("
    )
    body = splitting + "loader = DataLoader(data, batch_size=8, sampler=BucketSampler([3, 1]))\n"
    assert findings(DDP_PRELUDE, body) == []


EPOCH_SEEDED_SAMPLER = """
class BucketBatchSampler(torch.utils.data.Sampler):
    def __init__(self, lengths, rank, world, seed=0):
        self.lengths, self.rank, self.world, self.seed = lengths, rank, world, seed
        self.epoch = 0
    def set_epoch(self, epoch):
        self.epoch = epoch
    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))[self.rank :: self.world]
        rng.shuffle(order)
        return iter([order[i : i + 8] for i in range(0, len(order), 8)])
sampler = BucketBatchSampler(lengths, rank, world_size)
loader = DataLoader(data, batch_sampler=sampler)
for epoch in range(10):
    for batch in loader:
        model(batch).sum().backward()
"""


def test_the_files_own_sampler_seeded_by_its_epoch_needs_set_epoch_too() -> None:
    found = lint_snippet(
        "import random\n" + DDP_PRELUDE, EPOCH_SEEDED_SAMPLER, ["sampler-set-epoch"]
    )
    assert [line for line, _ in found] == [13]
    assert "BucketBatchSampler shuffles with a seed of its epoch" in found[0][1].message
    called = EPOCH_SEEDED_SAMPLER.replace(
        "for epoch in range(10):\n", "for epoch in range(10):\n    sampler.set_epoch(epoch)\n"
    )
    assert lint_snippet("import random\n" + DDP_PRELUDE, called, ["sampler-set-epoch"]) == []


def test_a_distributed_sampler_subclass_inherits_set_epoch_and_needs_it_called() -> None:
    # blind set aq 13: a bucketing sampler subclassing DistributedSampler, seeded
    # with self.seed + self.epoch, in a `while step < max_steps` loop of epochs
    body = """
from torch.utils.data import DistributedSampler
class BucketSampler(DistributedSampler):
    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.dataset), generator=g)[self.rank :: self.num_replicas].tolist())
class PlainSampler(DistributedSampler):
    def __len__(self):
        return super().__len__()
sampler = BucketSampler(data, shuffle=True)
loader = DataLoader(data, batch_size=8, sampler=sampler)
step = 0
while step < 100:
    for batch in loader:
        model(batch).sum().backward()
        step += 1
"""
    found = lint_snippet(DDP_PRELUDE, body, ["sampler-set-epoch"])
    assert [line for line, _ in found] == [11]
    assert "BucketSampler shuffles with a seed of its epoch" in found[0][1].message
    plain = body.replace("sampler = BucketSampler(", "sampler = PlainSampler(")
    assert [line for line, _ in lint_snippet(DDP_PRELUDE, plain, ["sampler-set-epoch"])] == [11]
    called = body.replace(
        "    for batch in loader:", "    sampler.set_epoch(step)\n    for batch in loader:"
    )
    assert lint_snippet(DDP_PRELUDE, called, ["sampler-set-epoch"]) == []
    unshuffled = body.replace("shuffle=True", "shuffle=False")
    assert lint_snippet(DDP_PRELUDE, unshuffled, ["sampler-set-epoch"]) == []


def test_a_comprehensions_own_names_are_not_the_files_other_names() -> None:
    """`vocab` is built from every rank's full list; `t` in its comprehension is
    not the `t` that another function reads from the rank."""
    body = """
    def shard(items):
        t = items[rank::world_size]
        return t
    items = read_all("train.tsv")
    vocab = sorted({t for _, t in items})
    model = DDP(torch.nn.Embedding(len(vocab), 8))
    """
    assert lint_snippet(DDP_PRELUDE, body, ["model-differs-across-ranks"]) == []


def test_a_shuffled_loader_only_a_forward_only_helper_reads_is_not_a_training_loader() -> None:
    """SWA's BatchNorm recalibration: the same seeded order on every rank on purpose."""
    body = """
    from torch.utils.data import DistributedSampler
    train = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    def bn_update(loader, net):
        for x, in loader:
            net(x)
    bn_loader = DataLoader(data, batch_size=8, shuffle=True)
    bn_update(bn_loader, model)
    """
    assert lint_snippet(DDP_PRELUDE, body, ["missing-distributed-sampler"]) == []
    training = body.replace("net(x)", "net(x).sum().backward()")
    assert [
        line for line, _ in lint_snippet(DDP_PRELUDE, training, ["missing-distributed-sampler"])
    ] == [7]


@pytest.mark.parametrize(
    "helper, reported",
    [
        # the rank only decides who downloads first: every rank still gets everything
        (
            (
                "def get_datasets(root, rank):\n"
                "    if rank != 0:\n"
                "        dist.barrier()\n"
                "    ds = torchvision.datasets.CIFAR10(root, download=(rank == 0))\n"
                "    if rank == 0:\n"
                "        dist.barrier()\n"
                "    return ds\n"
            ),
            True,
        ),
        # the rank picks this rank's share
        (
            (
                "def get_datasets(root, rank):\n"
                "    ds = torchvision.datasets.CIFAR10(root)\n"
                "    return Subset(ds, range(rank, len(ds), 8))\n"
            ),
            False,
        ),
        (
            (
                "def get_datasets(root, rank):\n"
                "    ds = torchvision.datasets.CIFAR10(root)\n"
                "    return Subset(ds, [i for i in range(len(ds)) if i % 8 == rank])\n"
            ),
            False,
        ),
    ],
    ids=["rank-compared", "rank-strided", "rank-modulo"],
)
def test_a_helper_given_the_rank_only_to_compare_it_does_not_shard(helper, reported) -> None:
    body = (
        "import torchvision\n"
        + helper
        + "train = get_datasets('data', rank)\n"
        + "loader = DataLoader(train, batch_size=8, shuffle=True)\n"
    )
    found = [cause for cause, _line in findings(DDP_PRELUDE, body)]
    assert ("missing-distributed-sampler" in found) == reported
    # blind set bd's 02: the rank read as `int(os.environ["RANK"])` is the rank's making,
    # not a share the helper cuts
    from_env = body.replace(
        "train = get_datasets", "import os\nrank = int(os.environ['RANK'])\ntrain = get_datasets"
    )
    found = [cause for cause, _line in findings(DDP_PRELUDE, from_env)]
    assert ("missing-distributed-sampler" in found) == reported


def test_a_dataset_that_splits_itself_over_the_ranks_needs_no_sampler() -> None:
    # mosaicml-streaming's StreamingDataset reads RANK / WORLD_SIZE and partitions itself
    body = (
        "from streaming import StreamingDataset\n"
        "train = StreamingDataset(remote='s3://bucket/mds', local='/tmp/mds', shuffle=True)\n"
        "loader = DataLoader(train, batch_size=8)\n"
    )
    assert findings(DDP_PRELUDE, body) == []


@pytest.mark.parametrize(
    "stages, reported",
    [
        (
            "wds.SimpleShardList(urls), wds.shuffle(100), wds.split_by_worker, wds.tarfile_to_samples()",
            True,
        ),
        (
            "wds.SimpleShardList(urls), wds.split_by_node, wds.split_by_worker, wds.shuffle(100)",
            False,
        ),
        ("wds.ResampledShards(urls), wds.tarfile_to_samples(), wds.shuffle(100)", False),
        ("wds.SimpleShardList(urls), wds.split_by_worker, wds.tarfile_to_samples()", False),
    ],
    ids=["training-unsplit", "split-by-node", "resampled", "evaluation-in-order"],
)
def test_a_webdataset_training_pipeline_needs_a_node_splitter(stages, reported) -> None:
    body = f"import webdataset as wds\npipeline = wds.DataPipeline({stages})\n"
    found = [cause for cause, _line in findings(DDP_PRELUDE, body)]
    assert found == (["missing-distributed-sampler"] if reported else [])


RAY_TRAIN_LOOP = """
import ray.train.torch
from torch.utils.data import DataLoader


def train_loop_per_worker(config):
    loader = DataLoader(make_dataset(), batch_size=64, shuffle={shuffle})
    loader = ray.train.torch.prepare_data_loader(loader{option})
    model = ray.train.torch.prepare_model(make_model())
    for epoch in range(config["epochs"]):
        {set_epoch}for x, y in loader:
            model(x).sum().backward()
"""


@pytest.mark.parametrize(
    ("shuffle", "option", "set_epoch", "reported"),
    [
        ("True", "", "", True),  # Ray's DistributedSampler shuffles by its epoch
        ("True", "", "loader.sampler.set_epoch(epoch)\n        ", False),
        ("False", "", "", False),  # a sequential sampler: one order on purpose
        ("True", ", add_dist_sampler=False", "", False),  # no sampler added
    ],
)
def test_a_loader_ray_prepares_needs_set_epoch_each_epoch(shuffle, option, set_epoch, reported):
    source = RAY_TRAIN_LOOP.format(shuffle=shuffle, option=option, set_epoch=set_epoch)
    found = [f for f in lint_source(source) if f.cause_id == "sampler-set-epoch"]
    assert bool(found) == reported


GRAPH_PRELUDE = """\
import dgl
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader

dist.init_process_group("nccl")
rank, world_size = dist.get_rank(), dist.get_world_size()
model = DDP(torch.nn.Linear(4, 1))
train_idx = split_idx["train"]
"""


@pytest.mark.parametrize(
    "body",
    [
        # blind set ae's 02: every rank samples the whole training split
        "loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=[10], shuffle=True)\n",
        "loader = dgl.dataloading.DataLoader(g, train_idx, sampler, batch_size=1024, shuffle=True)\n",
    ],
    ids=["pyg", "dgl"],
)
def test_a_graph_loader_of_every_seed_node_on_every_rank_is_reported(body: str) -> None:
    assert findings(GRAPH_PRELUDE, body) == [("missing-distributed-sampler", 1)]


@pytest.mark.parametrize(
    "body",
    [
        # each rank its own share of the seeds, or DGL splitting them
        (
            "mine = train_idx.tensor_split(world_size)[rank]\n"
            "loader = NeighborLoader(data, input_nodes=mine, num_neighbors=[10], shuffle=True)\n"
        ),
        "loader = NeighborLoader(data, input_nodes=train_idx[rank::world_size], num_neighbors=[10], shuffle=True)\n",
        "loader = dgl.dataloading.DataLoader(g, train_idx, sampler, use_ddp=True, shuffle=True)\n",
        # an evaluation loader every rank reads whole (not shuffled), or rank 0's own
        "loader = NeighborLoader(data, input_nodes=split_idx['test'], num_neighbors=[-1])\n",
        "if rank == 0:\n    loader = NeighborLoader(data, input_nodes=train_idx, shuffle=True)\n",
        # blind set dg's 05: a helper of the function returns this rank's block, in place
        (
            "def shard(idx):\n    n = idx.numel() // world_size\n"
            "    return idx[rank * n:(rank + 1) * n]\n"
            "loader = NeighborLoader(data, input_nodes=shard(train_idx), num_neighbors=[10], shuffle=True)\n"
        ),
    ],
    ids=["tensor-split", "strided", "use-ddp", "evaluation", "rank-zero", "helper-in-place"],
)
def test_a_graph_loader_split_by_rank_or_not_training_is_quiet(body: str) -> None:
    assert findings(GRAPH_PRELUDE, body) == []


@pytest.mark.parametrize(
    "sampler, reported",
    [
        # blind set be's 04: torchvision's detection reference with a RandomSampler
        ("GroupedBatchSampler(RandomSampler(data), group_ids, 8)", True),
        ("BatchSampler(SequentialSampler(data), 8, drop_last=True)", True),
        ("BatchSampler(DistributedSampler(data), 8, drop_last=True)", False),
        ("GroupedBatchSampler(my_sampler, group_ids, 8)", False),  # not known
    ],
)
def test_batches_grouped_from_a_sampler_of_the_whole_dataset(sampler, reported) -> None:
    body = (
        "from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler\n"
        "from torch.utils.data.distributed import DistributedSampler\n"
        f"batches = {sampler}\n"
        "loader = DataLoader(data, batch_sampler=batches)\n"
        "for x in loader:\n"
        "    model(x).sum().backward()\n"
    )
    found = [cause for cause, _line in findings(DDP_PRELUDE, body)]
    assert ("missing-distributed-sampler" in found) == reported, found


@pytest.mark.slow
def test_each_rank_draws_the_whole_dataset_through_a_random_batch_sampler_and_the_twin_half(
    torchrun,
) -> None:
    wait_broken = torchrun.start(SCRIPTS / "batch_sampler_over_a_random_sampler.py")
    wait_fixed = torchrun.start(SCRIPTS / "correct_batch_sampler_over_a_distributed_sampler.py")
    broken, fixed = wait_broken(), wait_fixed()
    assert broken.returncode == 0, broken.stderr[-2000:]
    assert broken.stdout.count("saw 16 samples") == 2
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert fixed.stdout.count("saw 8 samples") == 2


@pytest.mark.parametrize(
    "made, reported",
    [
        ("dataset = PygNodePropPredDataset(name='ogbn-products', root=root)", True),
        ("dataset = Planetoid(root, 'Cora')", True),
        ("dataset = DglGraphPropPredDataset(name='ogbg-molhiv', root=root)", True),
        (
            (
                "if rank == 0:\n    PygNodePropPredDataset(name='ogbn-products', root=root)\n"
                "dist.barrier()\ndataset = PygNodePropPredDataset(name='ogbn-products', root=root)"
            ),
            False,
        ),
    ],
    ids=["ogb", "pyg", "ogb-dgl", "rank-zero-first"],
)
def test_a_graph_dataset_that_downloads_when_built_is_built_by_every_rank(made, reported):
    # blind set bf's 01: OGB's and PyG's datasets download and process on construction
    source = (
        "import torch.distributed as dist\n"
        "from ogb.nodeproppred import PygNodePropPredDataset\n"
        "from ogb.graphproppred import DglGraphPropPredDataset\n"
        "from torch_geometric.datasets import Planetoid\n"
        "dist.init_process_group('nccl')\nrank = dist.get_rank()\nroot = 'data'\n" + made + "\n"
    )
    found = [f.cause_id for f in lint_source(source) if f.cause_id == "dataset-cache-race"]
    assert bool(found) == reported, found


CACHE_PER_ITEM = """
import os
import numpy as np
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
for i, item in enumerate(items):
    dst = os.path.join("cache", f"{i:05d}.npy")
    if os.path.exists(dst):
        continue
    WRITE
"""


@pytest.mark.parametrize(
    "write, reported",
    [
        ("np.save(dst, voxelize(item))", True),
        # blind set cz's 08: a temporary file renamed into place in one step
        (
            "tmp = f'{dst}.tmp.npy'\n    np.save(tmp, voxelize(item))\n    os.replace(tmp, dst)",
            False,
        ),
        (
            (
                "with open(dst + '.part', 'wb') as f:\n        pickle.dump(voxelize(item), f)\n"
                "    os.rename(dst + '.part', dst)"
            ),
            False,
        ),
        # renamed, but another file than the one written
        ("np.save(dst, voxelize(item))\n    os.replace(other, dst)", True),
        # blind set hy's 13: resampled audio kept as the cache
        ("import soundfile as sf\n    sf.write(dst, resample(item), 44100)", True),
        ("import torchaudio\n    torchaudio.save(dst, resample(item), 44100)", True),
        # blind set id's 03: a .npy memmap created and filled in place
        ("out = np.lib.format.open_memmap(dst, mode='w+', shape=(4, 8))\n    out[:] = 0", True),
        ("out = np.lib.format.open_memmap(dst, mode='r')", False),
    ],
    ids=[
        "in-place",
        "os-replace",
        "with-open-rename",
        "another-file-renamed",
        "soundfile",
        "torchaudio",
        "open_memmap",
        "open_memmap read",
    ],
)
def test_a_cache_file_renamed_into_place_is_never_read_half_written(write, reported):
    source = CACHE_PER_ITEM.replace("WRITE", write)
    found = [f.cause_id for f in lint_source(source) if f.cause_id == "dataset-cache-race"]
    assert bool(found) == reported, found


# Blind set ht's 08 (correct): while the k-means model is missing, each rank dumps
# its own slice of features to a file named by its rank, and rank 0 alone fits
# and writes the shared file; only a write of the shared file can race.
SHARED_BUILT_FROM_PARTS = """
import os
import numpy as np
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
if not os.path.exists(km_path):
    np.save(os.path.join(feat_dir, PART), features(items[rank::world]))
    dist.barrier()
    SHARED
    dist.barrier()
km = np.load(km_path)
"""


@pytest.mark.parametrize(
    ("part", "shared", "reported"),
    [
        ('f"{rank}.npy"', "if rank == 0:\n        np.save(km_path, fit(feat_dir))", []),
        ('"part.npy"', "if rank == 0:\n        np.save(km_path, fit(feat_dir))", [9]),
        ('f"{rank}.npy"', "np.save(km_path, fit(feat_dir))", [11]),
    ],
    ids=["a part per rank", "one part for all", "the shared file on every rank"],
)
def test_a_file_of_each_ranks_own_beside_a_cache_is_no_race(part, shared, reported):
    source = SHARED_BUILT_FROM_PARTS.replace("PART", part).replace("SHARED", shared)
    found = [f.line for f in lint_source(source) if f.cause_id == "dataset-cache-race"]
    assert found == reported


PREFETCH_LOADER = """
class PrefetchDataLoader(DataLoader):
    def __init__(self, num_prefetch_queue, **kwargs):
        self.num_prefetch_queue = num_prefetch_queue
        super().__init__(**kwargs)


class Batches(DataLoader):
    pass


{made}
for batch in loader:
    model(batch[0]).sum().backward()
"""


@pytest.mark.parametrize(
    "made, reported",
    [
        # blind set bo's 20: BasicSR's PrefetchDataLoader, a subclass of DataLoader
        ("loader = PrefetchDataLoader(num_prefetch_queue=4, dataset=data, shuffle=True)", True),
        ("loader = Batches(data, batch_size=8, shuffle=True)", True),
        # given a DistributedSampler; or handed its own first parameter positionally,
        # where DataLoader takes the dataset (not read: quiet rather than guess)
        (
            (
                "loader = PrefetchDataLoader(num_prefetch_queue=4, dataset=data,\n"
                "    sampler=torch.utils.data.distributed.DistributedSampler(data))"
            ),
            False,
        ),
        ("loader = PrefetchDataLoader(4, dataset=data, shuffle=True)", False),
    ],
    ids=["keywords", "subclass-positional", "sampler", "other-first-parameter"],
)
def test_the_files_own_dataloader_subclass_is_a_dataloader(made, reported):
    found = findings(DDP_PRELUDE, PREFETCH_LOADER.format(made=made))
    assert ("missing-distributed-sampler" in {cause for cause, _ in found}) == reported, found


TWO_SAMPLERS = """
src_sampler = DistributedSampler(data, shuffle=True)
tgt_sampler = DistributedSampler(data, shuffle=True, seed=1)
src_loader = DataLoader(data, batch_size=8, sampler=src_sampler)
tgt_loader = DataLoader(data, batch_size=8, sampler=tgt_sampler)
for epoch in range(10):
    src_sampler.set_epoch(epoch)
    TOLD
    for (xs,), (xt,) in zip(src_loader, tgt_loader):
        model(xs).sum().backward()
"""


@pytest.mark.parametrize(
    "told, reported",
    [
        ("pass", [("sampler-set-epoch", 3)]),  # blind set ce's 06: the target's order repeats
        ("tgt_sampler.set_epoch(epoch)", []),
        ("for s in (src_sampler, tgt_sampler): s.set_epoch(epoch)", []),  # not read: quiet
    ],
)
def test_a_second_sampler_never_told_the_epoch_is_reported(told, reported):
    assert findings(SAMPLER_PRELUDE, TWO_SAMPLERS.replace("TOLD", told)) == reported


def test_an_own_batch_sampler_over_a_distributed_sampler_is_split():
    # blind set by's 14 (torchvision's reference): GroupedBatchSampler batches the
    # DistributedSampler it is given, picked by an option beside torch's BatchSampler
    body = OWN_SAMPLER + (
        "from torch.utils.data import BatchSampler, DistributedSampler\n"
        "train_sampler = DistributedSampler(data)\n"
        "if args.group:\n"
        "    batches = BucketSampler(train_sampler)\n"
        "else:\n"
        "    batches = BatchSampler(train_sampler, 8, drop_last=True)\n"
        "loader = DataLoader(data, batch_sampler=batches)\n"
    )
    assert findings(DDP_PRELUDE, body) == []


MEMBER_PRELUDE = """\
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("nccl")
rank = dist.get_rank()
data = TensorDataset(torch.randn(64, 4))
model = torch.nn.Linear(4, 1).cuda()
"""
MEMBER_STEP = """
loader = DataLoader(data, batch_size=8, shuffle=True)
for (x,) in loader:
    model(x.cuda()).sum().backward()
scores = [None] * dist.get_world_size()
dist.all_gather_object(scores, rank)
"""


@pytest.mark.parametrize(
    ("extra", "reported"),
    [
        # blind set dm: each rank trains its own population member on all the data
        ("", []),
        # the ranks average their gradients (or weights) by hand: one model
        (
            "for p in model.parameters():\n    dist.all_reduce(p.grad)\n",
            [("missing-distributed-sampler", 2)],
        ),
        (
            "for p in model.parameters():\n    dist.all_reduce(p.data)\n",
            [("missing-distributed-sampler", 2)],
        ),
    ],
    ids=["own-models", "gradients-averaged", "weights-averaged"],
)
def test_ranks_that_each_train_a_model_of_their_own_read_all_the_data(extra, reported):
    assert findings(MEMBER_PRELUDE, MEMBER_STEP + extra) == reported


def test_ranks_that_share_one_job_without_training_still_split_it():
    """Blind set z's 04: an embedding pass over the corpus, gathered: each rank does all of it."""
    body = MEMBER_STEP.replace("    model(x.cuda()).sum().backward()\n", "    model(x.cuda())\n")
    assert findings(MEMBER_PRELUDE, body) == [("missing-distributed-sampler", 2)]


TRIAL_THEN_RETRAIN = """
def run_epoch(model, loader, opt):
    for x, y in loader:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def trial(config):
    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    loader = DataLoader(data, batch_size=8, shuffle=True)
    run_epoch(model, loader, opt)


def retrain(best):
    net = DDP(torch.nn.Linear(4, 1).cuda())
    opt = torch.optim.AdamW(net.parameters(), lr=best["lr"])
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    run_epoch(net, loader, opt)
"""


def test_a_trial_that_trains_a_model_of_its_own_reads_all_the_data():
    """Blind set dm's 02: successive halving, one trial per rank (its own model, no
    wrapper), then the winner retrained with DDP and a DistributedSampler."""
    assert findings(SAMPLER_PRELUDE, TRIAL_THEN_RETRAIN) == []
    wrapped = TRIAL_THEN_RETRAIN.replace(
        "    model = torch.nn.Linear(4, 1).cuda()\n",
        "    model = DDP(torch.nn.Linear(4, 1).cuda())\n",
    )
    assert findings(SAMPLER_PRELUDE, wrapped) == [("missing-distributed-sampler", 12)]


FFCV = """
import os
import torch.distributed as dist
from ffcv.loader import Loader, OrderOption
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
model = DDP(net, device_ids=[int(os.environ["LOCAL_RANK"])])
train = Loader("train.beton", batch_size=64, order=OrderOption.ORDER, pipelines=p{given})
"""


@pytest.mark.parametrize(
    "order, given, reported",
    [
        # blind set ei's 08: the training loader left without distributed=True
        ("RANDOM", "", True),
        ("QUASI_RANDOM", ", distributed=False", True),
        ("RANDOM", ", distributed=True", False),
        ("RANDOM", ", distributed=args.distributed", False),  # the run decides
        ("SEQUENTIAL", "", False),  # an evaluation may read everything
    ],
)
def test_an_ffcv_training_loader_needs_distributed_true(order, given, reported):
    source = FFCV.replace("ORDER", order).replace("{given}", given)
    found = [f for f in lint_source(source) if f.cause_id == "missing-distributed-sampler"]
    assert bool(found) == reported, found


@pytest.mark.parametrize(
    "owned, reported",
    [
        # blind set hf's 17 (correct): each rank builds its datasets from the assets it
        # owns, appended one by one in a loop over them
        ("[(i, t) for i, t in enumerate(tickers) if i % world_size == rank]", []),
        ("list(enumerate(tickers))", [("missing-distributed-sampler", 6)]),
    ],
)
def test_a_dataset_appended_from_this_ranks_own_items_is_cut_by_rank(owned, reported) -> None:
    body = f"""
    mine = {owned}
    parts = []
    for aid, ticker in mine:
        parts.append(Subset(data, load_rows(ticker, aid)))
    loader = DataLoader(torch.utils.data.ConcatDataset(parts), batch_size=8, shuffle=True)
    """
    assert findings(DDP_PRELUDE, body) == reported


@pytest.mark.parametrize(
    "helper, reported",
    [
        # blind set gu's 15: the target loader handed to a generator that yields its
        # batches to the training loop, the source loader to the same with its sampler
        (
            "def batches(loader, sampler=None):\n    while True:\n        yield from loader\n",
            [("missing-distributed-sampler", 4)],
        ),
        # a pass that only scores what it reads trains nothing
        (
            (
                "def batches(loader, sampler=None):\n"
                "    return sum(float(model(x).sum()) for (x,) in loader)\n"
            ),
            [],
        ),
    ],
)
def test_a_loader_handed_to_a_generator_of_batches_is_trained_on(helper, reported) -> None:
    body = (
        "src_sampler = DistributedSampler(data)\n"
        "src_loader = DataLoader(data, sampler=src_sampler)\n"
        "tgt = TensorDataset(torch.randn(64, 4))\n"
        "tgt_loader = DataLoader(tgt, batch_size=8, shuffle=True)\n"
        + helper
        + "src_it, tgt_it = batches(src_loader, src_sampler), batches(tgt_loader)\n"
        "for step in range(10):\n"
        "    (x,), (t,) = next(src_it), next(tgt_it)\n"
        "    (model(x).sum() + model(t).sum()).backward()\n"
    )
    assert findings(SAMPLER_PRELUDE, body) == reported
