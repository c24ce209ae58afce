"""assistant/lint/checks/gather_sizes.py: all_gather of the rows predicted over this
rank's contiguous block of the data, when the blocks differ in size (collective-mismatch).

A block of `ceil(n / world)` items clipped to the length (`min(n, (rank + 1) * per)`),
or one the last rank stretches to the end, holds fewer or more items on the last
rank, so buffers shaped like the local predictions do not match across ranks. Blocks
of `n // world` items each are the same size everywhere."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """\
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset
"""
BODY = """
def predict(model, loader):
    return torch.cat([model(x) for x in loader])


def main(model, test_ds):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = len(test_ds)
    per = -(-n // world)
    BLOCK
    preds = predict(model, DataLoader(part, batch_size=64))
    gathered = [torch.zeros_like(preds) for _ in range(world)]
    dist.all_gather(gathered, preds)
"""


def reported(block: str, body: str = BODY) -> list[int]:
    source = body.replace("BLOCK", block)
    return [line for line, _ in lint_snippet(PRELUDE, source, {"collective-mismatch"})]


@pytest.mark.parametrize(
    "block",
    [
        "part = Subset(test_ds, range(rank * per, min(n, (rank + 1) * per)))",
        (
            "end = n if rank == world - 1 else (rank + 1) * per\n"
            "    part = Subset(test_ds, list(range(n))[rank * per:end])"
        ),
        "start = rank * per\n    part = Subset(test_ds, range(start, min(start + per, n)))",
        # blind set cx's 19: blocks of ceil(n / world), clipped by Python's slicing
        "part = Subset(test_ds, list(range(n))[rank * per:(rank + 1) * per])",
        "per = math.ceil(n / world)\n    part = Subset(test_ds, list(range(n))[rank * per:(rank + 1) * per])",
        # blind set dc's 10: np.array_split's parts differ by one
        "part = Subset(test_ds, np.array_split(np.arange(n), world)[rank])",
        "part = Subset(test_ds, torch.arange(n).tensor_split(world)[rank])",
    ],
    ids=[
        "clipped range",
        "the last rank takes the rest",
        "start through a name",
        "sliced ceil blocks",
        "math.ceil blocks",
        "array_split",
        "tensor_split",
    ],
)
def test_a_clipped_or_stretched_block_makes_the_gathered_rows_rank_sized(block):
    assert reported(block) == [14 + block.count("\n")]


@pytest.mark.parametrize(
    "block, body",
    [
        # n // world items each, the remainder left out: the same size everywhere
        ("part = Subset(test_ds, range(rank * (n // world), (rank + 1) * (n // world)))", BODY),
        # the sizes exchanged first: a padded gather starts so
        (
            "part = Subset(test_ds, range(rank * per, min(n, (rank + 1) * per)))",
            BODY.replace(
                "    gathered = [",
                "    size = torch.tensor([preds.shape[0]])\n"
                "    sizes = [torch.zeros_like(size) for _ in range(world)]\n"
                "    dist.all_gather(sizes, size)\n"
                "    gathered = [",
            ),
        ),
        # blind set cq's 08: the sizes exchanged as objects, the pad a named difference
        (
            "part = Subset(test_ds, range(rank * per, min(n, (rank + 1) * per)))",
            BODY.replace(
                "    gathered = [",
                "    sizes = [None] * world\n"
                "    dist.all_gather_object(sizes, preds.size(0))\n"
                "    pad = max(sizes) - preds.size(0)\n"
                "    preds = torch.nn.functional.pad(preds, (0, 0, 0, pad))\n"
                "    gathered = [",
            ),
        ),
        # np.split refuses a length that does not divide: equal parts or an error
        ("part = Subset(test_ds, np.split(np.arange(n), world)[rank])", BODY),
        # a slice of n // world items each
        (
            "size = n // world\n    part = Subset(test_ds, list(range(n))[rank * size:(rank + 1) * size])",
            BODY,
        ),
        # blind set hl's 02 (correct): ceil blocks of a list wrapped around to per * world
        # items first, as DistributedSampler pads
        (
            (
                "idx = list(range(n))\n"
                "    padded = idx + idx[: per * world - n]\n"
                "    part = Subset(test_ds, padded[rank * per:(rank + 1) * per])"
            ),
            BODY,
        ),
    ],
    ids=[
        "even blocks",
        "sizes exchanged first",
        "sizes exchanged as objects",
        "np.split",
        "even sliced blocks",
        "ceil blocks of a padded list",
    ],
)
def test_even_blocks_or_exchanged_sizes_are_quiet(block, body):
    assert reported(block, body) == []


SHARE_HELPER = """
def shard(n, rank, world):
    return SHARE


def main(model, test_ds):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(test_ds, shard(len(test_ds), rank, world)), batch_size=64)
    preds = torch.cat([model(x) for x in loader])
    gathered = [torch.zeros_like(preds) for _ in range(world)]
    dist.all_gather(gathered, preds)
"""


@pytest.mark.parametrize(
    "share, reported_lines",
    [
        # blind set cn's 19: the file's helper returns this rank's strided share
        ("np.arange(n)[rank::world]", [12]),
        ("list(range(rank, n, world))", [12]),
        ("list(range(rank * (n // world), (rank + 1) * (n // world)))", []),  # even blocks
    ],
)
def test_a_share_the_files_helper_returns_makes_the_gathered_rows_rank_sized(share, reported_lines):
    assert reported("", SHARE_HELPER.replace("SHARE", share)) == reported_lines


def test_a_callers_selection_made_after_the_gather_is_not_what_was_gathered():
    # blind set cw's 18: the padded repeats masked out after the ids were gathered
    body = """
def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def main(model, test_ds):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.cat([y for _, y in DataLoader(test_ds, batch_size=64)])
    all_ids = gather(ids)
    real = ids >= 0
    ids = ids[real]
"""
    assert reported("", body) == []
    before = body.replace("    all_ids = gather(ids)\n", "").replace(
        "    ids = ids[real]\n", "    ids = ids[real]\n    all_ids = gather(ids)\n"
    )
    assert reported("", before) == [4]


ROLLOUT = """
@torch.no_grad()
def rollout(stepper, u, world):
    rank = dist.get_rank()
    rows = torch.arange(u.shape[0])
    SPLIT
    local = stepper(u[None, None, r0:r1])[0, 0]
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local)
    return torch.cat(pieces)
"""


@pytest.mark.parametrize(
    "split, reported_lines",
    [
        # blind set hn's 10: each rank's slab of grid rows, its ends from a
        # comprehension over tensor_split's parts
        (
            (
                "bounds = [(int(c[0]), int(c[-1]) + 1) for c in torch.tensor_split(rows, world)]\n"
                "    r0, r1 = bounds[rank]"
            ),
            [10],
        ),
        # the parts kept under a name, then this rank's read from it
        (
            "parts = np.array_split(rows.numpy(), world)\n    r0, r1 = parts[rank][0], parts[rank][-1] + 1",
            [10],
        ),
        # np.split refuses a length that does not divide: the slabs are equal
        (
            (
                "bounds = [(int(c[0]), int(c[-1]) + 1) for c in np.split(rows.numpy(), world)]\n"
                "    r0, r1 = bounds[rank]"
            ),
            [],
        ),
        # even slabs of n // world rows each
        ("per = u.shape[0] // world\n    r0, r1 = rank * per, (rank + 1) * per", []),
    ],
    ids=["ends of tensor_split parts", "array_split kept by name", "np.split", "even slabs"],
)
def test_a_ranks_part_of_an_uneven_split_read_through_a_name_sizes_the_gathered_rows(
    split, reported_lines
):
    assert reported("", ROLLOUT.replace("SPLIT", split)) == reported_lines
