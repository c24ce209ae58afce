"""The checks of assistant/lint/checks/rank_dependent.py: every rank calls the
collective, but the shape, dtype or count of its tensors depends on the rank
(collective-mismatch), or the number of times it is called does (uneven-inputs).
Each case is a function body; rank, world_size and a few tensors are defined
around it."""

from __future__ import annotations

import textwrap

import pytest

from assistant.lint import lint_source

PRELUDE = """\
import os
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def work(data, x):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
"""

FLAGGED = {
    "size_from_rank": "t = torch.zeros(rank + 1)\ndist.all_reduce(t)",
    "size_through_names": (
        "size = dist.get_rank() * 2 + 1\nfeat = torch.randn(size, 8)\n"
        "out = [torch.empty(4, 8) for _ in range(world_size)]\ndist.all_gather(out, feat)"
    ),
    "size_chosen_by_rank": "dist.all_reduce(torch.ones(10 if rank == 0 else 5))",
    "size_from_environment": (
        "n = int(os.environ['RANK']) + 1\nt = torch.empty(n, 3)\ndist.broadcast(t, src=0)"
    ),
    "list_length_from_rank": (
        "xs = [torch.zeros(2) for _ in range(rank + 1)]\ndist.all_gather(xs, torch.zeros(2))"
    ),
    "list_repeated_by_rank": (
        "xs = [torch.zeros(2)] * (local_rank + 1)\ndist.reduce_scatter(torch.zeros(2), xs)"
    ),
    "list_appended_in_a_rank_loop": (
        "xs = []\nfor _ in range(rank):\n    xs.append(torch.zeros(2))\n"
        "dist.all_gather(xs, torch.zeros(2))"
    ),
    "dtype_chosen_by_rank": (
        "t = torch.zeros(4, dtype=torch.float16 if rank == 0 else torch.float32)\n"
        "dist.all_reduce(t)"
    ),
    "two_literal_shapes_chosen_by_rank": (
        "t = torch.zeros(4) if rank == 0 else torch.zeros(8)\ndist.all_reduce(t)"
    ),
    "shape_kept_through_moves": (
        "t = torch.zeros(rank + 1)\nu = t.to(local_rank).float()\ndist.all_reduce(u)"
    ),
    "shape_copied_by_zeros_like": (
        "t = torch.zeros(rank + 1)\ndist.all_reduce(torch.zeros_like(t))"
    ),
    "arange_up_to_the_rank": "dist.all_reduce(torch.arange(rank).float())",
    "size_chosen_in_a_rank_branch": (
        "if rank == 0:\n    n = 10\nelse:\n    n = 5\nt = torch.zeros(n)\ndist.all_reduce(t)"
    ),
    "rows_unpacked_from_a_rank_shaped_tensor": (
        "t = torch.zeros(rank + 1, 4)\nn, d = t.shape\nu = torch.ones(n, d)\ndist.all_reduce(u)"
    ),
    "size_read_from_a_rank_shaped_tensor": (
        "t = torch.zeros(rank + 1)\nu = torch.ones(t.numel())\ndist.all_reduce(u)"
    ),
}

SILENT = {
    # blind set dk's 15: the comprehension's `c` holds the gathered counts, not the
    # rank-sized `c` made before it
    "comprehension_variable_of_gathered_counts": (
        "c = torch.zeros(rank + 1)\n"
        "counts = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]\n"
        "dist.all_gather(counts, torch.tensor([c.shape[0]]))\n"
        "max_n = max(int(c.item()) for c in counts)\n"
        "padded = torch.zeros(max_n, 8)\n"
        "bucket = [torch.empty_like(padded) for _ in range(world_size)]\n"
        "dist.all_gather(bucket, padded)"
    ),
    "device_placement": (
        "t = torch.zeros(4).to(rank)\nu = torch.zeros(4, device=local_rank)\n"
        "v = torch.zeros(4).cuda(local_rank)\nd = torch.device(f'cuda:{local_rank}')\n"
        "w = torch.ones(4, device=d)\n"
        "dist.all_reduce(t)\ndist.all_reduce(u)\ndist.all_reduce(v)\ndist.all_reduce(w)"
    ),
    "seed_and_log": (
        "torch.manual_seed(1234 + rank)\nprint(f'rank {rank} of {world_size}')\n"
        "t = torch.randn(4)\ndist.all_reduce(t)"
    ),
    "sampler_and_loader": (
        "sampler = DistributedSampler(data, num_replicas=world_size, rank=rank)\n"
        "loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
        "for batch in loader:\n    dist.all_reduce(torch.zeros(len(loader)))"
    ),
    "dataset_slice_counted_by_value": (
        "shard = data[rank::world_size]\nn = torch.tensor([len(shard)])\ndist.all_reduce(n)"
    ),
    "rank_in_values_only": (
        "a = torch.tensor([rank])\nb = torch.full((4,), rank)\n"
        "c = torch.randint(0, rank + 1, (4,))\n"
        "dist.all_reduce(a)\ndist.all_reduce(b)\ndist.all_reduce(c)"
    ),
    "world_size_is_the_same_everywhere": (
        "t = torch.zeros(world_size)\nxs = [torch.zeros(2) for _ in range(world_size)]\n"
        "dist.all_gather(xs, torch.zeros(2))\ndist.all_reduce(t)"
    ),
    "gather_list_on_the_root_only": (
        "gl = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None\n"
        "dist.gather(torch.tensor([float(rank)]), gl, dst=0)"
    ),
    "size_agreed_on_before_use": (
        "n = torch.tensor([rank + 1])\ndist.all_reduce(n, op=dist.ReduceOp.MAX)\n"
        "buf = torch.zeros(int(n.item()))\ndist.all_reduce(buf)"
    ),
    "reassigned_before_the_collective": (
        "t = torch.zeros(rank + 1)\nt = torch.zeros(4)\ndist.all_reduce(t)"
    ),
    "uneven_all_to_all_splits_are_allowed": (
        "splits = [rank + 1] * world_size\n"
        "dist.all_to_all_single(torch.zeros(8), x, output_split_sizes=splits)"
    ),
    "arange_window_moves_with_the_rank": (
        "idx = torch.arange(rank * 4, (rank + 1) * 4)\n"
        "out = [torch.zeros(4, dtype=torch.long) for _ in range(world_size)]\n"
        "dist.all_gather(out, idx)"
    ),
    "a_peer_rank_is_the_same_on_every_rank": (
        "dst_rank = world_size - 1\nshard_rank = x.placement.rank()\n"
        "t = torch.zeros(dst_rank + 1, shard_rank + 1)\ndist.all_reduce(t)"
    ),
    "broadcast_source_and_receivers_make_their_own_tensor": (
        "if rank == 0:\n    t = torch.tensor([1.0, 2.0])\nelse:\n    t = torch.empty(2)\n"
        "dist.broadcast(t, 0)"
    ),
    "the_single_process_branch_is_not_a_rank_choice": (
        "if local_rank == -1:\n    n_gpu = 4\nelse:\n    n_gpu = 1\n"
        "dist.all_reduce(torch.zeros(n_gpu))"
    ),
    "a_size_chosen_by_rank_then_broadcast": (
        "if rank == 0:\n    n = 10\nelse:\n    n = 0\nsize = torch.tensor([n])\n"
        "dist.broadcast(size, 0)\nbuf = torch.empty(int(size.item()))\ndist.broadcast(buf, 0)"
    ),
    # blind set cs's 11: feature sizes unpacked from a shard's batch are the model's
    "feature_sizes_unpacked_from_a_shape": (
        "shard = range(rank, 64, world_size)\nfor i in shard:\n    e = x[i]\n"
        "    b, d, h, w = e.shape\n    s = torch.zeros(h * w, d)\n"
        "    c, k = e.size()\n    u = torch.zeros(k)\n"
        "dist.all_reduce(s)\ndist.all_reduce(u)"
    ),
    "object_collectives_pickle_any_size": (
        "obj = list(range(rank))\nout = [None] * world_size\ndist.all_gather_object(out, obj)"
    ),
}


UNEVEN_LOOPS = {
    "range_of_the_rank": "for _ in range(rank + 1):\n    dist.all_reduce(x)",
    "range_of_a_name_from_the_rank": (
        "steps = 10 // world_size + (1 if rank < 10 % world_size else 0)\n"
        "for _ in range(steps):\n    dist.barrier()"
    ),
    "steps_chosen_in_a_rank_branch": (
        "if rank == 0:\n    steps = 6\nelse:\n    steps = 5\n"
        "for _ in range(steps):\n    dist.all_reduce(x)"
    ),
    "while_over_a_rank_dependent_bound": (
        "step = 0\nlimit = 3 + rank\nwhile step < limit:\n    step += 1\n    dist.all_reduce(x)"
    ),
    "list_repeated_by_rank": (
        "batches = [torch.ones(2)] * (4 if rank == 0 else 2)\n"
        "for batch in batches:\n    dist.all_reduce(batch)"
    ),
    "list_built_for_the_rank": (
        "losses = [torch.zeros(1) for _ in range(local_rank + 2)]\n"
        "for loss in losses:\n    dist.all_reduce(loss)"
    ),
}

EVEN_LOOPS = {
    "range_of_the_world_size": "for _ in range(world_size):\n    dist.all_reduce(x)",
    "loader_with_a_distributed_sampler": (
        "sampler = DistributedSampler(data, rank=rank)\n"
        "for batch in DataLoader(data, sampler=sampler):\n    dist.all_reduce(batch)"
    ),
    "shard_of_a_dataset": (
        "shard = data[rank::world_size]\n"
        "for i in range(len(shard)):\n    dist.all_reduce(torch.zeros(len(shard)))"
    ),
    "while_until_a_flag_every_rank_agreed_on": (
        "done = torch.tensor([0])\nwhile not done.item():\n    dist.all_reduce(x)\n"
        "    done = torch.tensor([int(rank == 0)])\n    dist.all_reduce(done, op=dist.ReduceOp.MAX)"
    ),
    "rank_loop_without_a_collective": ("for i in range(rank):\n    print(i)\ndist.all_reduce(x)"),
    "collective_guarded_by_rank_inside": (
        "for i in range(world_size):\n    if i == rank:\n        print(i)\n    dist.barrier()"
    ),
}


def in_function(body: str) -> str:
    return PRELUDE + textwrap.indent(body, "    ") + "\n"


@pytest.mark.parametrize("name", sorted(FLAGGED))
def test_rank_dependent_arguments_are_flagged_on_the_collective_line(name: str) -> None:
    source = in_function(FLAGGED[name])
    last_line = len(source.splitlines())
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("collective-mismatch", last_line)]
    assert "depends on the rank" in findings[0].message
    assert "line " in findings[0].message  # where the rank-dependent value was made


@pytest.mark.parametrize("name", sorted(SILENT))
def test_rank_used_elsewhere_is_not_flagged(name: str) -> None:
    assert lint_source(in_function(SILENT[name])) == []


def test_message_names_the_collective_the_tensor_and_where_it_was_made() -> None:
    findings = lint_source(in_function("t = torch.zeros(rank + 1)\ndist.all_reduce(t)"))
    message = findings[0].message
    assert message.startswith("all_reduce() is called by every rank, but the shape of t")
    assert "(torch.zeros(rank + 1), line 12)" in message


def test_a_collective_only_some_ranks_reach_is_reported_once() -> None:
    # The reach check names it; the argument check leaves guarded calls alone.
    body = "if rank == 0:\n    dist.all_reduce(torch.zeros(rank + 1))"
    findings = lint_source(in_function(body))
    assert len(findings) == 1
    assert "runs on rank 0 only" in findings[0].message


def test_a_method_follows_attributes_of_self() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "class Trainer:\n"
        "    def sync(self):\n"
        "        self.buf = torch.zeros(self.rank + 1)\n"
        "        dist.all_reduce(self.buf)\n"
    )
    assert [(f.cause_id, f.line) for f in lint_source(source)] == [("collective-mismatch", 6)]


@pytest.mark.parametrize("name", sorted(UNEVEN_LOOPS))
def test_a_collective_in_a_loop_of_rank_dependent_length_is_uneven_inputs(name: str) -> None:
    source = in_function(UNEVEN_LOOPS[name])
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [("uneven-inputs", len(source.splitlines()))]
    assert "whose count depends on the rank" in findings[0].message


@pytest.mark.parametrize("name", sorted(EVEN_LOOPS))
def test_loops_every_rank_runs_as_often_are_not_flagged(name: str) -> None:
    assert lint_source(in_function(EVEN_LOOPS[name])) == []


def test_the_origin_of_a_loop_count_is_named() -> None:
    body = "steps = rank + 3\nfor _ in range(steps):\n    dist.barrier()"
    message = lint_source(in_function(body))[0].message
    assert "barrier() runs once per item of range(steps), whose count" in message
    assert "(steps = rank + 3, line 12)" in message


def test_a_size_chosen_by_a_rank_test_names_the_test() -> None:
    body = "if rank == 0:\n    n = 10\nelse:\n    n = 5\ndist.all_reduce(torch.ones(n))"
    message = lint_source(in_function(body))[0].message
    assert "(torch.ones(n), with n = 5 under `if rank == 0`, line 16)" in message


def test_one_walk_of_the_data_flow_yields_both_kinds_of_finding(monkeypatch) -> None:
    from assistant.lint.checks import rank_dependent

    walked = []
    walk = rank_dependent.flow_walk
    monkeypatch.setattr(
        rank_dependent, "flow_walk", lambda script: walked.append(1) or walk(script)
    )
    body = (
        "t = torch.zeros(rank + 1)\ndist.all_reduce(t)\n"
        "for batch in [torch.ones(2)] * (4 if rank == 0 else 2):\n    dist.all_reduce(batch)"
    )
    source = in_function(body)
    last = len(source.splitlines())
    findings = lint_source(source)
    assert [(f.cause_id, f.line) for f in findings] == [
        ("collective-mismatch", last - 2),
        ("uneven-inputs", last),
    ]
    assert walked == [1]  # both cause ids from one walk of the script's data flow


@pytest.mark.parametrize(
    "returned, reported",
    [("meta['step']", False), ("meta['step'] + rank", True)],
    ids=["shared-step", "step-from-rank"],
)
def test_a_helper_given_the_rank_taints_its_result_only_through_what_it_returns(
    returned, reported
) -> None:
    # load_checkpoint reads this rank's shard, but every rank resumes at the same step
    source = (
        "import json\nimport torch\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nrank = dist.get_rank()\n"
        "def load_checkpoint(model, rank):\n"
        "    meta = json.load(open('latest.json'))\n"
        "    shard = torch.load(f'shard_rank{rank}.pt')\n"
        "    model.load_state_dict(shard)\n"
        f"    return {returned}\n"
        "step = load_checkpoint(model, rank)\n"
        "while step < 100:\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    step += 1\n"
    )
    found = [f.cause_id for f in lint_source(source)]
    assert ("uneven-inputs" in found) == reported, found


@pytest.mark.parametrize(
    "unpack, reported",
    [
        ("sampler, train_loader, val_loader = build_data(data, rank, world)", False),
        ("sampler, val_loader, train_loader = build_data(data, rank, world)", True),
        ("train_loader = build_data(data, rank, world)[1]", False),
        ("train_loader = build_data(data, rank, world)[2]", True),
    ],
    ids=["train-element", "val-element", "indexed-train", "indexed-val"],
)
def test_each_name_unpacked_from_a_helper_depends_on_its_own_element(unpack, reported):
    # blind set bh's correct 08: the helper cuts only the validation set by the rank;
    # the training loader, element 1, has as many batches on every rank
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.utils.data import DataLoader, DistributedSampler, Subset\n"
        "dist.init_process_group('gloo')\nrank, world = dist.get_rank(), dist.get_world_size()\n"
        "def build_data(data, rank, world):\n"
        "    sampler = DistributedSampler(data, drop_last=True)\n"
        "    train_loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
        "    val_loader = DataLoader(Subset(data, range(rank, len(data), world)))\n"
        "    return sampler, train_loader, val_loader\n"
        f"{unpack}\n"
        "for step in range(len(train_loader)):\n"
        "    dist.all_reduce(torch.ones(1))\n"
    )
    found = [f.cause_id for f in lint_source(source)]
    assert ("uneven-inputs" in found) == reported, found


# A callback object of the file built with the rank (blind set az: Keras' BackupAndRestore
# ported by hand), whose method returns the epoch to resume from.
CALLBACK = """\
import torch
import torch.distributed as dist


class Backup:
    def __init__(self, path, rank):
        self.path, self.rank = path, rank

    def start_epoch(self):
        if self.rank == 0:
            print("restoring", self.path)
        state = torch.load(self.path, map_location="cpu")
        return RETURNED


def main():
    dist.init_process_group("gloo")
    backup = Backup("backup.pt", dist.get_rank())
    start = backup.start_epoch()
    for epoch in range(start, 10):
        dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize(
    "returned, found",
    [
        ('state["epoch"] + 1', []),  # the rank only picks who prints
        ('state["epoch"] + self.rank', [("uneven-inputs", 21)]),
    ],
)
def test_a_method_of_an_object_built_with_the_rank_depends_on_what_it_returns(returned, found):
    findings = lint_source(CALLBACK.replace("RETURNED", returned))
    assert [(f.cause_id, f.line) for f in findings if f.cause_id == "uneven-inputs"] == found


# A trainer object of the file built with the rank (blind set ht's 09), whose step
# counter the outer loop reads.
TRAINER = """\
import torch
import torch.distributed as dist


class Trainer:
    def __init__(self, args, rank, shards):
        self.args, self.rank = args, rank
        self.step = START

    def train_step(self, batch):
        self.step += 1


def main(args):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = Trainer(args, rank, list(range(100))[rank::3])
    while trainer.step < args.max_update:
        trainer.train_step(None)
        dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize(
    ("start", "found"),
    [
        ("0", []),  # a counter every rank starts at 0 and steps alike
        ("rank * 10", [("uneven-inputs", 20)]),  # started from the rank
        ("self.rank * 10", [("uneven-inputs", 20)]),  # through another field
    ],
    ids=["a counter", "from the rank", "through another field"],
)
def test_a_field_of_an_object_built_with_the_rank_depends_on_what_the_class_assigns_it(
    start, found
):
    findings = lint_source(TRAINER.replace("START", start))
    assert [(f.cause_id, f.line) for f in findings if f.cause_id == "uneven-inputs"] == found


@pytest.mark.parametrize(
    "body, reported",
    [
        # blind set bk's 03: each rank creates only the groups it belongs to
        (
            (
                "for i in range(world // 2):\n"
                "    ranks = list(range(i * 2, (i + 1) * 2))\n"
                "    if rank in ranks:\n"
                "        group = dist.new_group(ranks)\n"
            ),
            [4],
        ),
        ("if rank == 0:\n    group = dist.new_group([0, 1])\n", [2]),
        # every rank creates every group and keeps its own
        (
            (
                "for i in range(world // 2):\n"
                "    ranks = list(range(i * 2, (i + 1) * 2))\n"
                "    g = dist.new_group(ranks)\n"
                "    if rank in ranks:\n"
                "        group = g\n"
            ),
            [],
        ),
        ("if world > 1:\n    group = dist.new_group(list(range(world)))\n", []),
        ("if args.local_rank != -1:\n    group = dist.new_group(list(range(world)))\n", []),
    ],
    ids=["member-only", "rank-zero", "every-rank", "world-test", "distributed-test"],
)
def test_a_group_only_some_ranks_create_is_reported(body, reported):
    source = (
        "import torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "rank, world = dist.get_rank(), dist.get_world_size()\n" + body
    )
    found = [f.line - 3 for f in lint_source(source) if f.cause_id == "collective-mismatch"]
    assert found == reported


@pytest.mark.parametrize(
    "returned, reported",
    [
        # blind set cs's 12: what a helper returns from the buffers it gathered into is
        # every rank's, the same everywhere
        ("torch.cat([o[:s] for o, s in zip(out, sizes)])", False),
        ("padded", True),  # this rank's own padded rows
    ],
)
def test_what_a_helper_returns_from_its_gathered_buffers_is_the_same_on_every_rank(
    returned, reported
) -> None:
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "def gather_varlen(t):\n"
        "    world = dist.get_world_size()\n"
        "    n = torch.tensor([t.shape[0]])\n"
        "    sizes = [torch.zeros_like(n) for _ in range(world)]\n"
        "    dist.all_gather(sizes, n)\n"
        "    sizes = [int(s.item()) for s in sizes]\n"
        "    padded = torch.zeros((max(sizes),) + tuple(t.shape[1:]))\n"
        "    padded[: t.shape[0]] = t\n"
        "    out = [torch.empty_like(padded) for _ in range(world)]\n"
        "    dist.all_gather(out, padded)\n"
        f"    return {returned}\n"
        "dist.init_process_group('gloo')\nrank = dist.get_rank()\n"
        "mine = list(range(rank, 10, dist.get_world_size()))\n"
        "feats = gather_varlen(torch.randn(len(mine), 4))\n"
        "k = max(1, int(0.1 * len(feats)))\n"
        "sel = torch.randperm(len(feats))[:k] if rank == 0 else torch.empty(k, dtype=torch.long)\n"
        "dist.broadcast(sel, src=0)\n"
    )
    found = [f.cause_id for f in lint_source(source) if f.cause_id == "collective-mismatch"]
    assert bool(found) == reported, found


def test_an_element_past_a_nested_functions_shorter_tuple_is_read_from_the_helpers_own():
    # a helper whose nested function returns a pair: element 2 is the helper's own
    # third, not an element of the inner pair (reading the inner returns crashed)
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.utils.data import DataLoader, DistributedSampler, Subset\n"
        "dist.init_process_group('gloo')\nrank, world = dist.get_rank(), dist.get_world_size()\n"
        "def build_data(data, rank, world):\n"
        "    def split(items):\n"
        "        return items[:10], items[10:]\n"
        "    sampler = DistributedSampler(data, drop_last=True)\n"
        "    train_loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
        "    val_loader = DataLoader(Subset(data, range(rank, len(data), world)))\n"
        "    return sampler, train_loader, val_loader\n"
        "val_loader = build_data(data, rank, world)[2]\n"
        "for step in range(len(val_loader)):\n"
        "    dist.all_reduce(torch.ones(1))\n"
    )
    assert "uneven-inputs" in [f.cause_id for f in lint_source(source)]
