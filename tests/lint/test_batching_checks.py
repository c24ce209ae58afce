"""uneven-inputs: a batch sampler that shards the samples by rank, then batches
each rank's share on its own by length or bucket."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "length_batches_packed_per_rank.py"
FIXED = SCRIPTS / "correct_length_batches_packed_then_shared.py"

HEADER = """
from collections import defaultdict
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
dist.init_process_group("nccl")
model = DDP(net)
"""

BUCKETS = """
class BucketSampler:
    def __init__(self, sizes, batch_size, rank, world):
        self.batch_size = batch_size
        self.by_bucket = defaultdict(list)
        for idx in range(rank, len(sizes), world):
            self.by_bucket[sizes[idx]].append(idx)
    def __iter__(self):
        for idxs in self.by_bucket.values():
            for i in range(0, len(idxs), self.batch_size):
                yield idxs[i : i + self.batch_size]
"""


def reported_lines(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(HEADER, body, ["uneven-inputs"])]


@pytest.mark.slow
def test_the_fixture_fails_as_linted_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun, BROKEN, RANKS_STOPPED_MATCHING, FIXED, "trained rank"
    )


def test_aspect_buckets_filled_from_a_rank_stride_are_reported():
    lines = reported_lines(
        BUCKETS + "loader = DataLoader(ds, batch_sampler=BucketSampler(sizes, 4, rank, world))\n"
    )
    assert lines == [6]


def test_a_sampler_held_in_a_name_is_followed():
    lines = reported_lines(
        BUCKETS
        + "train_bs = BucketSampler(sizes, 4, rank, world)\nloader = DataLoader(ds, batch_sampler=train_bs)\n"
    )
    assert lines == [6]


@pytest.mark.parametrize(
    "tail",
    [
        # DDP's own answer to uneven inputs
        "loader = DataLoader(ds, batch_sampler=BucketSampler(sizes, 4, rank, world))\nwith model.join():\n    train(loader)\n",
        # a sampler class defined but never a DataLoader's batch_sampler
        "sampler = BucketSampler(sizes, 4, rank, world)\n",
    ],
    ids=["join", "unused"],
)
def test_quiet_where_the_counts_cannot_differ_in_training(tail: str):
    assert reported_lines(BUCKETS + tail) == []


@pytest.mark.parametrize(
    "sampler",
    [
        # batches cut over all samples first, then shared out by rank
        """
        class Shared:
            def __init__(self, sizes, rank, world):
                self.rank, self.world = rank, world
                self.by_bucket = defaultdict(list)
                for i, s in enumerate(sizes):
                    self.by_bucket[s].append(i)
            def __iter__(self):
                batches = [b for idxs in self.by_bucket.values() for b in (idxs[:4], idxs[4:8])]
                for b in self.bucket_list(batches):
                    yield b
            def bucket_list(self, batches):
                return batches[self.rank :: self.world]
        """,
        # the ranks agree on the smallest count
        """
        class Shared:
            def __init__(self, sizes, rank, world):
                self.by_bucket = defaultdict(list)
                for idx in range(rank, len(sizes), world):
                    self.by_bucket[sizes[idx]].append(idx)
            def __iter__(self):
                batches = [idxs for idxs in self.by_bucket.values()]
                n = torch.tensor(len(batches))
                dist.all_reduce(n, op=dist.ReduceOp.MIN)
                return iter(batches[: int(n)])
        """,
        # a plain stride with a fixed batch size: no grouping by data
        """
        class Shared:
            def __init__(self, n, rank, world):
                self.idx = list(range(n))[rank::world]
            def __iter__(self):
                for i in range(0, len(self.idx), 4):
                    yield self.idx[i : i + 4]
        """,
    ],
    ids=["cut-then-shared", "min-count", "fixed-size"],
)
def test_quiet_where_every_rank_gets_the_same_count(sampler: str):
    import textwrap

    body = (
        textwrap.dedent(sampler)
        + "loader = DataLoader(ds, batch_sampler=Shared(sizes, rank, world))\n"
    )
    assert reported_lines(body) == []


ITERABLE = """
class FrameBatcher(torch.utils.data.IterableDataset):
    def __init__(self, shards, max_frames):
        self.shards, self.max_frames = shards, max_frames
    def __iter__(self):
        batch, frames = [], 0
        for utt in read(self.shards):
            if frames + len(utt) > self.max_frames:
                yield batch
                batch, frames = [], 0
            batch.append(utt)
            frames += len(utt)
my_shards = all_shards[rank::world]
"""


def test_an_iterable_batcher_handed_a_ranks_shards_is_reported():
    body = ITERABLE + "loader = DataLoader(FrameBatcher(my_shards, 20000), batch_size=None)\n"
    assert reported_lines(body) == [13]


def test_an_iterable_dataset_the_loader_batches_by_count_is_left_alone():
    body = ITERABLE + "loader = DataLoader(FrameBatcher(my_shards, 20000), batch_size=8)\n"
    assert reported_lines(body) == []


DEALT = """
class TokenBatches:
    def __init__(self, lengths, max_tokens, rank, world):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.rank, self.num_replicas = rank, world
    def batches(self):
        out, cur = [], []
        for i in sorted(range(len(self.lengths)), key=self.lengths.__getitem__):
            if cur and self.lengths[i] * (len(cur) + 1) > self.max_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur){trim}
        return out
    def __iter__(self):
        return iter(self.batches()[self.rank :: self.num_replicas])
loader = DataLoader(ds, batch_sampler=TokenBatches(lengths, 4096, rank, world))
"""


@pytest.mark.parametrize(
    "trim, reported",
    [
        ("", [16]),
        ("\n        out = out[: len(out) - len(out) % self.num_replicas]", []),
        ("\n        out += out[: -len(out) % self.num_replicas]", []),
    ],
    ids=["untrimmed", "trimmed", "padded"],
)
def test_batches_cut_over_all_samples_must_be_trimmed_before_they_are_dealt_out(trim, reported):
    # len(out) % world batches left over: those ranks run one step more than the others
    assert reported_lines(DEALT.format(trim=trim)) == reported


# Cut in a method below __init__, which keeps the batches and counts a rank's share of them
# (blind set bx's 06, a correct script): the stride walks the batches, not the samples.
CUT_BELOW_INIT = """
class BucketBatches:
    def __init__(self, durations, max_seconds, rank, world_size, pad=True):
        self.durations, self.max_seconds = durations, max_seconds
        self.rank, self.world_size = rank, world_size
        self._batches = self._bucketize(){count}
    def _bucketize(self):
        batches, cur = [], []
        for i in sorted(range(len(self.durations)), key=self.durations.__getitem__):
            if cur and self.durations[i] * (len(cur) + 1) > self.max_seconds:
                batches.append(cur)
                cur = []
            cur.append(i)
        return batches + [cur]
    def __iter__(self):
        batches = list(self._batches)
        return iter(batches[self.rank :: self.world_size][: self.num_batches])
loader = DataLoader(ds, batch_sampler=BucketBatches(durations, 60.0, rank, world))
"""


@pytest.mark.parametrize(
    "count, reported",
    [
        # padded for training, each rank's own count for evaluation (bx's 06)
        (
            (
                "\n        if pad:\n            self.num_batches = len(self._batches) // world_size"
                "\n        else:\n            self.num_batches = len(range(rank, len(self._batches), world_size))"
            ),
            [],
        ),
        ("\n        self.num_batches = len(range(rank, len(self._batches), world_size))", [7]),
    ],
    ids=["trimmed", "untrimmed"],
)
def test_batches_cut_in_a_method_below_init_are_dealt_out_not_cut_per_rank(count, reported):
    found = lint_snippet(HEADER, CUT_BELOW_INIT.format(count=count), ["uneven-inputs"])
    assert [line for line, _ in found] == reported
    assert all("cuts its batches over all samples" in f.message for _, f in found)


# A training loop of the file's own that steps through a rank's share of a list of
# batches (blind set av: token-bucketed translation batches dealt out by rank).
LOOP = """
def train(model, optimizer, batches, rank, world):
    TRIM
    for step, batch in ITERATED:
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
"""


def loop_lines(iterated: str, trim: str = "pass") -> list[int]:
    body = LOOP.replace("ITERATED", iterated).replace("TRIM", trim)
    return [line for line, _ in lint_snippet(HEADER, body, ["uneven-inputs"])]


@pytest.mark.slow
def test_a_loop_over_a_rank_stride_of_batches_hangs_under_torchrun_and_the_trimmed_twin_runs(
    torchrun,
):
    assert_broken_fails_and_twin_runs(
        torchrun,
        SCRIPTS / "training_loop_over_a_rank_stride_of_batches.py",
        RANKS_STOPPED_MATCHING,
        SCRIPTS / "correct_training_loop_over_a_trimmed_rank_stride.py",
        "trained 3 steps",
    )


@pytest.mark.parametrize(
    "iterated",
    ["enumerate(batches[rank::world])", "enumerate(tqdm(batches[rank::world]))"],
)
def test_a_training_loop_over_a_rank_stride_is_reported(iterated):
    assert loop_lines(iterated) == [4]


@pytest.mark.parametrize(
    "trim",
    [
        "batches = batches[: len(batches) // world * world]",
        "batches = batches[: len(batches) - len(batches) % world]",
        # blind set av's 16: trimmed to a multiple of a name made from the world size
        "chunk = world * accum\n    batches = batches[: len(batches) // chunk * chunk]",
    ],
)
def test_a_list_trimmed_to_a_multiple_of_the_world_size_is_quiet(trim):
    assert loop_lines("enumerate(batches[rank::world])", trim) == []


def test_a_learning_rate_scaled_by_the_world_size_trims_nothing():
    # blind set jl's 20: `lr * math.sqrt(world)` beside a loop over the rank's views
    assert loop_lines("enumerate(batches[rank::world])", "lr = 1e-3 * math.sqrt(world)") == [4]


def test_a_copy_of_the_rank_stride_shuffled_in_place_is_the_stride():
    # blind set jl's 20: `order = my_ids[:]`, shuffled, then looped
    trim = "mine = batches[rank::world]\n    order = mine[:]\n    random.shuffle(order)"
    assert loop_lines("enumerate(order)", trim) == [6]


def test_a_mean_over_the_rank_stride_trims_nothing():
    # blind set ca's 01: `total / max(1, len(my_batches))`, my_batches the rank's stride
    trim = "mine = batches[rank::world]\n    share = 1.0 / max(1, len(mine))"
    assert loop_lines("enumerate(mine)", trim) == [5]


def test_a_loop_with_no_backward_is_quiet():
    # an evaluation over a rank's share has no all-reduce to wait in
    assert [
        line
        for line, _ in lint_snippet(
            HEADER,
            "def score(model, items, rank, world):\n"
            "    return [model(x) for x in items[rank::world]]\n",
            ["uneven-inputs"],
        )
    ] == []


SHARD_THEN_PACK = """
rank, world = dist.get_rank(), dist.get_world_size()
docs = load_dataset("json", data_files="train.jsonl", split="train")
BUILD
loader = DataLoader(blocks, batch_size=8, shuffle=True, drop_last=True)
for batch in loader:
    model(**batch).loss.backward()
"""


@pytest.mark.parametrize(
    "build, reported",
    [
        # blind set bb's 18: each rank packs the documents of its own shard into blocks
        (
            (
                "mine = docs.shard(num_shards=world, index=rank, contiguous=True)\n"
                "blocks = mine.map(pack, batched=True, remove_columns=mine.column_names)"
            ),
            [6],
        ),
        ("blocks = docs.shard(world, rank).filter(lambda d: len(d['text']) > 100)", [5]),
        # packed first, then shared out in equal shares of the packed rows
        (
            (
                "packed = docs.map(pack, batched=True)\n"
                "blocks = packed.shard(num_shards=world, index=rank)"
            ),
            [],
        ),
        # one row per document: the shards keep the data's (near equal) counts
        ("blocks = docs.shard(num_shards=world, index=rank).map(tokenize)", []),
    ],
)
def test_a_dataset_shard_each_rank_repacks_runs_its_own_number_of_steps(build, reported):
    body = SHARD_THEN_PACK.replace("BUILD", build)
    assert reported_lines(body) == reported
