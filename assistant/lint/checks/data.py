"""Data-loading checks: a DataLoader every rank reads in full, a sampler never told the epoch,
a training loader over the files each rank takes for itself (uneven shares).

Both mistakes are silent (no error, only wasted or repeated work), so both
checks stay quiet whenever the script may handle it some other way: a
sampler of its own, a dataset sharded by rank, Lightning or Accelerate
building the sampler, or a loader only rank 0 reads. A stream (an
IterableDataset, a streamed Hugging Face dataset) takes no sampler: a
training loader over one is reported only when nothing in its making, nor
in its class's code, names a rank or a split.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from functools import cached_property, wraps
from itertools import chain, islice
from typing import TypeGuard, TypeVar

from assistant.lint.checks.rank_dependent import is_placement, target_value_pairs
from assistant.lint.model import (
    COMPREHENSIONS,
    FILE_READERS,
    MOVES,
    Script,
    bound_arguments,
    called_name,
    children,
    enclosing_loop,
    full_text,
    keyword,
    names_in,
    own_nodes,
    parameter_names,
    self_attribute,
    short,
    source_text,
    unmoved,
    walk,
)
from assistant.lint.ranks import (
    NO_RANKS,
    RANK_ZERO,
    RankPath,
    enclosing_scope,
    is_rank_expr,
    without_int,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    COMPOSER,
    DEEPSPEED_ENGINE,
    PROCESS_COUNT,
    calls_any,
    imports_package,
    is_backward,
    is_collective,
    is_ddp,
    is_dist_call,
    is_distributed,
    is_method,
)
from assistant.lint.tracer import same_file_callees
from assistant.results import Finding

# DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...): a fourth
# positional argument is a sampler given by position.
SAMPLER_POSITION = 3
SHUFFLE_POSITION = 2
# DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last): the fifth is the seed.
SEED_POSITION = 4
# `g.manual_seed(epoch)`, `rng.seed(epoch)`: a generator seeded by a statement, not an assignment.
SEEDING_METHODS = frozenset({"manual_seed", "seed"})
# Frameworks that give every loader they build or prepare a distributed sampler
# (Lightning's Trainer), or that shard the stream themselves (webdataset).
SAMPLER_FRAMEWORKS = ("lightning", "pytorch_lightning", "webdataset")
# Launchers that start a process per GPU but give no loader a sampler themselves.
SCRIPT_SAMPLED_LAUNCHERS = COMPOSER | {("ray", "TorchTrainer")}
# `accelerator.prepare(loader)`, `fabric.setup_dataloaders(loader)`: rebuilt with a sampler.
PREPARERS = frozenset({"prepare", "prepare_data_loader", "setup_dataloaders"})
# Words of a sampler that splits by rank (`self.rank`, `num_replicas`,
# `get_world_size()`, "WORLD_SIZE", a shard or a part): any of them keeps it quiet.
SPLIT_WORDS = re.compile(r"rank|replica|world|shard|part|split|distributed", re.IGNORECASE)
# torch's samplers that draw from the whole dataset: handed to a DataLoader in a DDP
# script, every rank draws its own full epoch (WeightedRandomSampler's num_samples
# from every index), as with the file's own unsplit sampler.
WHOLE_SET_SAMPLERS = frozenset({"WeightedRandomSampler", "RandomSampler"})
# Calls that list or read files: data a function returns through them was not made there.
FILE_READS = FILE_READERS | {"glob", "iglob", "rglob", "listdir", "scandir"}
# A test of whether the run is distributed: its branches are for one process or for N.
DISTRIBUTED_TEST = re.compile(
    r"distributed|world|ddp|rank|is_initialized|is_available|n_?gpu|num_gpus|parallel|"
    r"replicas|nprocs",
    re.IGNORECASE,
)
# How many same-file base classes of a sampler are read (a cycle of bases ends here).
MAX_LINEAGE = 16
# A name that holds a list of files or shards.
# Lists whose items hold different amounts of data: files and shards, and the
# episodes, demos, trajectories, videos and recordings a dataset cuts into windows.
FILE_LIST = re.compile(
    r"file|shard|path|episode|demo|traj|video|clip|recording|rollout", re.IGNORECASE
)
LOADER_PACKAGES = ("torch.", "torch_geometric.", "monai.")
# Packages whose datasets split the samples over the ranks themselves.
SELF_SPLITTING_PACKAGES = ("streaming.",)
ITERABLE_BASES = frozenset({"IterableDataset", "IterDataPipe"})
# Names in the making of a stream split between ranks (or in the code of a stream class).
STREAM_SPLIT_WORDS = re.compile(
    r"split_dataset_by_node|shard|rank|world_size|replica", re.IGNORECASE
)
# How many assignments back a dataset's origin is followed (ds = Subset(base, idx); idx = ...):
# files[rank::world] read, split, then wrapped in a Dataset is four steps back.
ORIGIN_DEPTH = 5
# A name assigned hundreds of times is not a dataset being built; stop following there.
MAX_ORIGINS = 64


@check("missing-distributed-sampler")
def check_missing_distributed_sampler(script: Script) -> Iterator[Finding]:
    """A DataLoader with no sampler in a DDP script that has no DistributedSampler, or a
    shuffled (training) one left without it where other loaders have one."""
    data = DataFlow(script)
    if data.uses_framework or data.model_parallel_only or data.independent_models:
        return
    if not data.is_distributed:
        # An Accelerate script starts no process group itself: its loaders are
        # split by prepare(), and one it trains on without preparing is not.
        yield from unprepared_training_loaders(script, data)
        return
    # Where the script uses a DistributedSampler, a loader without one may be
    # meant to read everything (an evaluation on every rank); a loader that
    # shuffles is a training loader.
    only_shuffled = data.mentions_distributed_sampler or bool(
        PREPARERS & script.called_short_names
    )  # a loader prepared (Ray, Accelerate, Fabric) is split like one with a sampler
    for node in data.loader_calls:
        dataset = loader_dataset(node)
        if dataset is None or has_sampler(node) or data.prepared(node):
            continue
        if only_shuffled and (not shuffles(node) or data.only_scored(node)):
            continue
        if data.sharded_by_rank(dataset):
            continue
        if data.may_be_iterable(dataset):
            # A stream takes no sampler: it is split in its own making, or not at all.
            if data.unsplit_training_stream(node, dataset):
                yield script.finding(
                    "missing-distributed-sampler",
                    node,
                    f"DataLoader over {source_text(dataset)}, a stream (an IterableDataset) "
                    "that nothing splits by rank: a DistributedSampler cannot cut it, so "
                    "every rank trains on the same examples in the same order; split it "
                    "(datasets' split_dataset_by_node(ds, rank=rank, world_size=world), "
                    ".shard(num_shards=world, index=rank), or skip by rank in __iter__)",
                )
            continue
        if data.rank_zero_only(node) or data.read_into_memory(node):
            continue
        if data.made_by_its_own_training_loop(node, dataset):
            continue
        if trains_a_model_of_its_own(script, node):
            continue
        shown = source_text(dataset)
        why = (
            "shuffles with no sampler while the script gives other loaders a DistributedSampler"
            if only_shuffled
            else "has no sampler and the script has no DistributedSampler"
        )
        yield script.finding(
            "missing-distributed-sampler",
            node,
            f"DataLoader over {shown} {why}: every rank iterates the whole dataset, so N ranks "
            f"do N times the work with no speedup; {sampler_fix(script, shown)}",
        )


@check("missing-distributed-sampler")
def check_ffcv_loader_read_whole_by_every_rank(script: Script) -> Iterator[Finding]:
    """An FFCV `Loader(..., order=OrderOption.RANDOM)` (a training order) without
    `distributed=True` in a script that trains across processes: FFCV splits the
    dataset between the ranks only when told, so every rank trains on all of it."""
    loaders = [
        node
        for node, name in script.call_names
        if name.startswith("ffcv.") and short(name) == "Loader"
    ]
    if not loaders:
        return  # no FFCV: the data flow is not worth building here
    data = DataFlow(script)
    if not data.is_distributed or data.uses_framework or data.independent_models:
        return
    for node in loaders:
        order = keyword(node, "order")
        if order is None or "RANDOM" not in source_text(order):
            continue  # sequential: an evaluation may read everything on purpose
        distributed = keyword(node, "distributed")
        if distributed is not None and not (
            isinstance(distributed, ast.Constant) and distributed.value is False
        ):
            continue  # True, or an option the run decides
        yield script.finding(
            "missing-distributed-sampler",
            node,
            f"FFCV Loader over {source_text(node.args[0]) if node.args else 'its dataset'} "
            "in a random order without distributed=True: FFCV gives each process its own "
            "share only when told, so every rank trains on the whole dataset (N times the "
            "work, epochs N times longer); pass distributed=True",
        )


def trains_a_model_of_its_own(script: Script, loader: ast.Call) -> bool:
    """The function that builds the loader also builds the model it trains, an
    optimizer over it and a backward (its own, or a helper's it calls), with no DDP or
    FSDP wrapper there: each rank
    trains its own (a search trial, a population member) and reads all the data,
    however another function of the file later trains one model together."""
    scope = enclosing_scope(loader, script)
    if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    nodes = list(script.scope_nodes(scope))
    calls = [(n, script.name_of(n.func)) for n in nodes if isinstance(n, ast.Call)]
    if any(
        short(name) in DATA_PARALLEL_WRAPPERS
        or averages_a_gradient(n, name)
        or averages_weights(script, n, name)
        or wraps_in_a_helper(script, n)
        for n, name in calls
    ):
        return False  # wrapped (here or by a helper of the file), or by hand
    if not any(is_backward(n) or runs_a_backward(script, n) for n, _name in calls):
        return False
    built = {
        target.id
        for n in nodes
        if isinstance(n, ast.Assign) and isinstance(unmoved(n.value), ast.Call)
        for target in n.targets
        if isinstance(target, ast.Name)
    }  # `model = MLP(...).to(device)`: made here
    return any(
        name.startswith("torch.optim.")
        and any(
            isinstance(inner, ast.Call)
            and called_name(inner) == "parameters"
            and isinstance(inner.func, ast.Attribute)
            and isinstance(inner.func.value, ast.Name)
            and inner.func.value.id in built
            and inner.func.value.id not in parameter_names(scope)
            for argument in n.args[:1]
            for inner in walk(argument)
        )
        for n, name in calls
    )


def runs_a_backward(script: Script, call: ast.Call) -> bool:
    """A call of the file's own function that runs a backward (`run_epoch(model, ...)`)."""
    if not isinstance(call.func, ast.Name):
        return False
    function = script.functions.get(call.func.id)
    return function is not None and any(is_backward(n) for n in walk(function))


# What wraps a model for data parallelism: torch's, and the libraries' that wrap it in
# DDP (Ray's prepare_model, Accelerate's prepare, Fabric's setup, DeepSpeed's initialize).
TORCH_WRAPPERS = frozenset({"DistributedDataParallel", "FullyShardedDataParallel", "fully_shard"})


def wraps_in_a_helper(script: Script, call: ast.Call) -> bool:
    """`policy = build(mesh, ...)`: a function of the file that wraps what it builds
    (DDP, FSDP, fully_shard), so the model it returns trains together."""
    function = script.functions.get(called_name(call)) if isinstance(call.func, ast.Name) else None
    return function is not None and any(
        isinstance(node, ast.Call) and short(script.name_of(node.func)) in DATA_PARALLEL_WRAPPERS
        for node in walk(function)
    )


DATA_PARALLEL_WRAPPERS = TORCH_WRAPPERS | {
    "DDP", "FSDP", "prepare_model", "prepare", "setup", "setup_module", "initialize"
}  # fmt: skip


def loader_dataset(loader: ast.Call) -> ast.expr | None:
    """What a DataLoader call reads: its first argument, or `dataset=`."""
    return loader.args[0] if loader.args else keyword(loader, "dataset")


def own_loader_classes(script: Script) -> dict[str, ast.ClassDef]:
    """The file's classes that subclass torch's DataLoader, by name."""
    return {
        node.name: node
        for node in script.tree.body
        if isinstance(node, ast.ClassDef)
        and any(
            short(script.name_of(base)) == "DataLoader"
            and script.name_of(base).startswith(LOADER_PACKAGES)
            for base in node.bases
        )
    }


def takes_the_dataset_first(cls: ast.ClassDef, call: ast.Call) -> bool:
    """The call hands the subclass its dataset where DataLoader takes it: by keyword
    only, or first, where the subclass's __init__ (if any) takes `dataset` first."""
    if not call.args:
        return True
    init = next(
        (s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None
    )
    return init is None or [a.arg for a in init.args.args[1:2]] == ["dataset"]


# torch's samplers that draw from the whole dataset, whoever runs them.
WHOLE_DATASET_SAMPLERS = frozenset({"RandomSampler", "SequentialSampler"})


@check("missing-distributed-sampler")
def check_batches_drawn_from_the_whole_dataset(script: Script) -> Iterator[Finding]:
    """A training loader whose sampler, or the sampler its batch sampler groups
    (`GroupedBatchSampler(RandomSampler(ds), group_ids, bs)`, torchvision's detection
    reference with the DistributedSampler swapped out), is torch's RandomSampler or
    SequentialSampler in a DDP script: every rank draws from the whole dataset."""
    data = DataFlow(script)
    if not data.is_distributed or data.uses_framework or data.model_parallel_only:
        return
    for node in data.loader_calls:
        given = keyword(node, "batch_sampler") or keyword(node, "sampler")
        dataset = loader_dataset(node)
        if given is None or dataset is None or data.sharded_by_rank(dataset):
            continue
        base = whole_dataset_sampler(script, given)
        if base is None or not data.trains_on(node) or data.rank_zero_only(node):
            continue
        yield script.finding(
            "missing-distributed-sampler",
            node,
            f"the batches of this DataLoader come from {source_text(base.func)}(...) (line "
            f"{base.lineno}), which draws from the whole dataset on every rank: N ranks do "
            "N times the work with no speedup; draw them from "
            f"DistributedSampler({source_text(dataset)}) instead (a batch sampler can group "
            "its indices as it groups the random ones)",
        )


def whole_dataset_sampler(script: Script, given: ast.expr, depth: int = 6) -> ast.Call | None:
    """torch's RandomSampler / SequentialSampler under a loader's sampler: itself, or
    the first argument of the batch sampler that groups it, through names assigned
    in every branch alike (`if grouped: bs = Grouped(s, ...) else: bs = BatchSampler(s, ...)`)."""
    if depth == 0:
        return None
    if isinstance(given, ast.Name):
        values = script.assigned_values.get(given.id, [])
        found = [whole_dataset_sampler(script, v, depth - 1) for v in values]
        return found[0] if found and all(f is not None for f in found) else None
    if not isinstance(given, ast.Call):
        return None
    if short(script.name_of(given.func)) in WHOLE_DATASET_SAMPLERS:
        return given
    inner = given.args[0] if given.args else keyword(given, "sampler")
    return whole_dataset_sampler(script, inner, depth - 1) if inner is not None else None


def unprepared_training_loaders(script: Script, data: DataFlow) -> Iterator[Finding]:
    """In a script that hands its loaders to `accelerator.prepare(...)`, a shuffled one
    built and trained on without it (a loader rebuilt each round over a new subset):
    every process iterates all of it."""
    if not any(data.prepared(node) for node in data.loader_calls):
        return
    for node in data.loader_calls:
        dataset = loader_dataset(node)
        if dataset is None or has_sampler(node) or data.prepared(node) or not shuffles(node):
            continue
        if not data.iterated_where_built(node) or data.sharded_by_rank(dataset):
            continue
        if data.may_be_iterable(dataset) or data.rank_zero_only(node):
            continue
        yield script.finding(
            "missing-distributed-sampler",
            node,
            f"DataLoader over {source_text(dataset)} shuffles and is trained on without "
            "accelerator.prepare(...), while the script prepares its other loaders: it has "
            "no sampler, so every process iterates all of it and N processes do N times "
            "the work; hand it to accelerator.prepare(...) too",
        )


# Graph mini-batch loaders: each step samples the neighbourhoods of a batch of seed
# nodes, and the seeds are the loader's own argument (PyG's `input_nodes=`, DGL's
# second argument); no sampler splits them, and DGL splits them only with use_ddp=True.
GRAPH_LOADERS = {
    "torch_geometric.loader.NeighborLoader": "input_nodes",
    "torch_geometric.loader.HGTLoader": "input_nodes",
    "torch_geometric.loader.ShaDowKHopSampler": "node_idx",
    "dgl.dataloading.DataLoader": None,
    "dgl.dataloading.NodeDataLoader": None,
}


@check("missing-distributed-sampler")
def check_graph_loader_seeds_not_split(script: Script) -> Iterator[Finding]:
    """A shuffled graph loader whose seed nodes every rank takes whole: `NeighborLoader(
    data, input_nodes=split_idx["train"], shuffle=True)` on every rank of a DDP run."""
    data = DataFlow(script)
    if not data.is_distributed or not data.data_parallel:
        return
    for node, name in script.call_names:
        if name not in GRAPH_LOADERS or not shuffles(node) or data.rank_zero_only(node):
            continue
        seeds = graph_loader_seeds(node, GRAPH_LOADERS[name])
        if seeds is None or data.sharded_by_rank(seeds) or not is_falsy(keyword(node, "use_ddp")):
            continue
        word = GRAPH_LOADERS[name]
        fix = (
            "pass use_ddp=True"
            if word is None
            else f"pass {word}={source_text(seeds)}.tensor_split(world_size)[rank]"
        )
        yield script.finding(
            "missing-distributed-sampler",
            node,
            f"{short(name)} draws its batches from {source_text(seeds)}, every seed node, on "
            "every rank: a graph loader takes no DistributedSampler, so each rank trains on "
            f"the whole split and N ranks do N times the work; {fix} (each "
            "rank its own share of the seeds)",
        )


def graph_loader_seeds(loader: ast.Call, word: str | None) -> ast.expr | None:
    """The seed nodes a graph loader is given: PyG's by keyword (`input_nodes=`),
    DGL's as its second argument (`indices=`, NodeDataLoader's `nids=`)."""
    if word is not None:
        return keyword(loader, word)
    if len(loader.args) > 1:
        return loader.args[1]
    return keyword(loader, "indices") or keyword(loader, "nids")


# webdataset's pipelines: a list of stages from the shard list to the samples.
WEBDATASET_PIPELINES = frozenset({"webdataset.DataPipeline"})
WEBDATASET_READERS = WEBDATASET_PIPELINES | {"webdataset.WebDataset"}
# What gives each rank its own shards: a node splitter, or shards drawn at random per rank.
NODE_SPLITS = re.compile(r"split_by_node|nodesplitter|ResampledShards|resampled", re.IGNORECASE)
SHUFFLES = re.compile(r"shuffle", re.IGNORECASE)


@check("missing-distributed-sampler")
def check_webdataset_not_split_by_node(script: Script) -> Iterator[Finding]:
    """`wds.DataPipeline(wds.SimpleShardList(urls), wds.shuffle(...), ...)` for training
    in a distributed script with no `wds.split_by_node` (or resampled shards): a
    DistributedSampler cannot cut a stream, so every rank reads every shard."""
    if not is_distributed(script):
        return
    for node, name in script.call_names:
        if name not in WEBDATASET_PIPELINES:
            continue
        stages = named_parts(node)
        if any(NODE_SPLITS.search(part) for part in stages) or not trains_on(node, name):
            continue  # split by rank, or an evaluation pipeline read in order
        yield script.finding(
            "missing-distributed-sampler",
            node,
            "this webdataset pipeline shuffles (a training stream) but has no node "
            "splitter: every rank reads every shard, so the ranks train on the same "
            "samples and an epoch is N times the data; add wds.split_by_node after the "
            "shard list (before split_by_worker), or draw shards with ResampledShards",
        )


# What gives every rank the same number of batches whatever its shards hold: a
# fixed epoch length (with_epoch, usually over resampled shards), webdataset's
# old ddp_equalize, or DDP's join context for uneven inputs.
EQUAL_STEPS = re.compile(r"\.with_epoch\(|\bddp_equalize\b|\bJoin\(|\.join\(\s*\)")
BACKWARD = re.compile(r"\bbackward\(")


@check("uneven-inputs")
def check_webdataset_split_without_equal_steps(script: Script) -> Iterator[Finding]:
    """A training stream of webdataset shards split by node (`nodesplitter=
    wds.split_by_node`, or the stage in a DataPipeline), not resampled, in a file
    that never fixes the epoch's length: shards hold different numbers of samples
    (and each worker drops or keeps its own partial batch), so each rank's loader
    runs out after its own number of steps, and the ranks still training wait in
    the gradient all-reduce for the ones that left."""
    if not is_distributed(script) or not BACKWARD.search(script.source):
        return
    if EQUAL_STEPS.search(script.source):
        return
    for node, name in script.call_names:
        if name not in WEBDATASET_READERS:
            continue
        parts = named_parts(node)
        split = "split_by_node" in parts and not is_resampled(node, parts)
        if not split or not trains_on(node, name):
            continue
        yield script.finding(
            "uneven-inputs",
            node,
            "these shards are split by node, so each rank reads its own shards, which "
            "hold different numbers of samples; the epoch runs until the rank's loader "
            "is exhausted, so the ranks run different numbers of steps and the ones "
            "still training wait in the gradient all-reduce (a hang at the end of the "
            "epoch); give every rank the same number of batches: resampled=True with "
            ".with_epoch(n) on the loader (or .with_epoch(n) under the smallest rank's "
            "count)",
        )


def named_parts(node: ast.AST) -> set[str]:
    """Every name, attribute and keyword named under `node` (`wds.split_by_node`,
    `shardshuffle=`); walked, not unparsed, so a deep argument costs no recursion."""
    parts = set()
    for child in walk(node):
        if isinstance(child, ast.Name):
            parts.add(child.id)
        elif isinstance(child, ast.Attribute):
            parts.add(child.attr)
        elif isinstance(child, ast.keyword) and child.arg:
            parts.add(child.arg)
    return parts


def is_resampled(node: ast.Call, parts: set[str]) -> bool:
    """Shards drawn at random by every rank: `resampled=True` or ResampledShards."""
    return "ResampledShards" in parts or not is_falsy(keyword(node, "resampled"))


def is_falsy(value: ast.expr | None) -> bool:
    """Absent, or a literal None, False or 0."""
    return value is None or (isinstance(value, ast.Constant) and not value.value)


def trains_on(node: ast.Call, name: str) -> bool:
    """A training stream: shards shuffled (`shardshuffle=` a number or True), or a
    DataPipeline with a shuffle stage; an evaluation reads its shards in order."""
    if name in WEBDATASET_PIPELINES:
        return any(SHUFFLES.search(part) for part in named_parts(node))
    return not is_falsy(keyword(node, "shardshuffle"))


@check("sampler-set-epoch")
def check_sampler_set_epoch(script: Script) -> Iterator[Finding]:
    """A shuffling DistributedSampler whose set_epoch is never called in an epoch
    loop: not at all, or only once before the loop (`sampler.set_epoch(start_epoch)`
    on resuming, then `for epoch in range(start_epoch, epochs):` without it)."""
    data = DataFlow(script)
    calls = data.set_epoch_calls
    if any(inside_a_loop(call, script) for call in calls):
        return  # some call may run each epoch
    own = epoch_seeded_samplers(script)
    prepared = ray_prepared_shuffled(data)
    for sampler in [*data.sampler_calls, *own, *prepared]:
        if shuffle_off(sampler):
            continue
        # Ray's sampler sits inside the loader prepare_data_loader returns: the loader is
        # the call's own name, and it is never built anew with a seed of the epoch.
        if sampler in prepared:
            loaders = set(data.names_bound_to(sampler))
        else:
            loaders = data.loaders_of(sampler)
        loop = data.epoch_loop_over(loaders, near=sampler)
        if loop is None:
            # `cycle(train_loader)`, the file's `while True: for batch in loader: yield`:
            # the passes run inside the function the loader is handed to
            loop = data.pass_loop_of_a_helper(loaders)
        if loop is None or (sampler not in prepared and data.reseeded_each_pass(sampler, loaders)):
            continue
        if sampler in prepared:
            kind = "the DistributedSampler ray.train.torch.prepare_data_loader adds"
        else:
            kind = source_text(sampler.func) if sampler in own else "DistributedSampler"
        if not calls:
            yield script.finding(
                "sampler-set-epoch",
                sampler,
                f"{kind} shuffles with a seed of its epoch, but set_epoch is never "
                f"called while the loop on line {loop.lineno} runs the epochs, so every epoch "
                "sees the same order: call sampler.set_epoch(epoch) at the start of each epoch",
            )
            continue
        scope = enclosing_scope(loop, script)
        before = [
            call
            for call in calls
            if call.lineno < loop.lineno and enclosing_scope(call, script) is scope
        ]
        if len(before) != len(calls):
            continue  # called elsewhere too (a function the loop runs)
        if epoch_from_the_caller(script, before[-1], loop):
            continue
        yield script.finding(
            "sampler-set-epoch",
            before[-1],
            f"set_epoch runs once, before the loop on line {loop.lineno} runs the epochs: "
            f"{kind} keeps that epoch's seed, so every epoch sees the same order; call "
            "sampler.set_epoch(epoch) at the start of each epoch, inside the loop",
        )


@check("sampler-set-epoch")
def check_a_sampler_left_out_of_set_epoch(script: Script) -> Iterator[Finding]:
    """`src_sampler.set_epoch(epoch)` in the epoch loop, and a second shuffling
    DistributedSampler (`tgt_sampler`) whose loader the same loop reads but which is
    never told the epoch: that loader's order repeats every epoch. Read only where
    every set_epoch call names its sampler plainly, so the file shows which get it."""
    data = DataFlow(script)
    calls = data.set_epoch_calls
    told = {
        call.func.value.id
        for call in calls
        if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
    }
    if (
        not calls
        or len(told) != len(calls)
        or not any(inside_a_loop(call, script) for call in calls)
    ):
        return
    samplers = {id(s): s for s in data.sampler_calls}
    bound = {
        name: sampler for sampler in samplers.values() for name in data.names_bound_to(sampler)
    }
    if not told <= set(bound):
        return  # a set_epoch on something else (a loader's sampler through a helper)
    for name, sampler in bound.items():
        if name in told or shuffle_off(sampler) or "." in name:
            continue
        loaders = data.loaders_of(sampler)
        loop = data.epoch_loop_over(loaders, near=sampler)
        if loop is None or data.reseeded_each_pass(sampler, loaders):
            continue
        others = ", ".join(sorted(told))
        yield script.finding(
            "sampler-set-epoch",
            sampler,
            f"set_epoch is called on {others} but never on {name}, whose loader the loop on "
            f"line {loop.lineno} also reads: {name} keeps its first epoch's order every "
            f"epoch; call {name}.set_epoch(epoch) beside the others",
        )


EPOCH_NAME = re.compile(r"epoch|^ep$|^e$", re.IGNORECASE)


def epoch_from_the_caller(script: Script, set_epoch: ast.Call, loop: ast.AST) -> bool:
    """`def train_epoch(self, epoch): sampler.set_epoch(epoch)`, then a loop that
    repeats the loader within the epoch (`for _ in range(repeats_per_epoch)`): the
    epoch is a parameter, so the function is called once per epoch by its caller.
    Not when the loop itself counts the epochs from that value (`for epoch in
    range(start_epoch, n)` after `set_epoch(start_epoch)`)."""
    if not set_epoch.args or not isinstance(set_epoch.args[0], ast.Name):
        return False
    value = set_epoch.args[0].id
    if value not in parameter_names(enclosing_scope(set_epoch, script)):
        return False
    if not isinstance(loop, ast.For | ast.AsyncFor):
        return False
    counted = {n.id for n in walk(loop.target) if isinstance(n, ast.Name)}
    iterated = {n.id for n in walk(loop.iter) if isinstance(n, ast.Name)}
    return value not in iterated and not any(EPOCH_NAME.search(name) for name in counted)


def ray_prepared_shuffled(data: DataFlow) -> list[ast.Call]:
    """`ray.train.torch.prepare_data_loader(loader)` of a loader built with
    shuffle=True and no sampler: Ray gives it a shuffling DistributedSampler, whose
    epoch the script must still set (`loader.sampler.set_epoch(epoch)`)."""
    found = []
    for node, name in data.script.call_names:
        if not (name.startswith("ray.") and short(name) == "prepare_data_loader" and node.args):
            continue
        added = keyword(node, "add_dist_sampler")
        if isinstance(added, ast.Constant) and added.value is False:
            continue
        given = node.args[0]
        made = [given]
        if isinstance(given, ast.Name):
            made += data.assignments.get(given.id, [])
        if any(
            isinstance(value, ast.Call)
            and value in data.loader_calls
            and shuffles(value)
            and not has_sampler(value)
            for value in made
        ):
            found.append(node)
    return found


def inside_a_loop(node: ast.AST, script: Script) -> bool:
    """A for / while loop of the same function holds `node`."""
    parent = script.parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
        if isinstance(parent, ast.For | ast.While | ast.AsyncFor):
            return True
        parent = script.parents.get(id(parent))
    return False


def epoch_seeded_samplers(script: Script) -> list[ast.Call]:
    """Calls of the file's own sampler classes that shuffle by their epoch: the
    class defines set_epoch, or inherits it from DistributedSampler, and reads
    self.epoch elsewhere (a seed + epoch); a DistributedSampler subclass that
    keeps the base's __iter__ shuffles by it too."""
    classes = set()
    for cls in script.of_type(ast.ClassDef):
        methods = [m for m in cls.body if isinstance(m, ast.FunctionDef)]
        inherits = any(called_name_of(base) == "DistributedSampler" for base in cls.bases)
        if not inherits and not any(m.name == "set_epoch" for m in methods):
            continue
        if any(
            self_attribute(node) == "epoch" and isinstance(node.ctx, ast.Load)
            for m in methods
            if m.name not in ("set_epoch", "__init__")
            for node in walk(m)
        ) or (inherits and not any(m.name == "__iter__" for m in methods)):
            classes.add(cls.name)
    return [
        node
        for node in script.of_type(ast.Call)
        if isinstance(node.func, ast.Name) and node.func.id in classes
    ]


def expands_each_item(init: ast.FunctionDef, parameter: str) -> bool:
    """__init__ walks `parameter` with a loop whose body runs a loop of its own that
    collects (append / extend / +=; a `while t + win <= n:` over the item's length
    too): each item becomes as many samples as it holds."""
    for loop in walk(init):
        if not (
            isinstance(loop, ast.For)
            and parameter in {n.id for n in walk(loop.iter) if isinstance(n, ast.Name)}
        ):
            continue
        for inner in (n for statement in loop.body for n in walk(statement)):
            if isinstance(inner, ast.For | ast.While | ast.comprehension) and collects(inner):
                return True
    return False


def collects(loop: ast.AST) -> bool:
    """The loop (or comprehension) adds to a collection: `.append`, `.extend`, `+=`."""
    if isinstance(loop, ast.comprehension):
        return True
    return any(
        (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("append", "extend")
        )
        or isinstance(n, ast.AugAssign)
        for statement in loop.body
        for n in walk(statement)
    )


def kept_parameter(init: ast.FunctionDef, field: str) -> str | None:
    """The __init__ parameter `self.<field>` is set to (`self.n = n`, `self.a, self.n = a, n`)."""
    parameters = {a.arg for a in init.args.args[1:]}
    for node in walk(init):
        if not isinstance(node, ast.Assign):
            continue
        for target, value in target_value_pairs(node):
            if (
                self_attribute(target) == field
                and isinstance(value, ast.Name)
                and value.id in parameters
            ):
                return value.id
    return None


@check("uneven-inputs")
def check_rank_file_shards_of_uneven_length(script: Script) -> Iterator[Finding]:
    """A training DataLoader over the files (or episodes, videos) this rank takes (`files[rank::world]`):
    the ranks hold different numbers of batches, and the first to run out
    leaves the others waiting in DDP's gradient all-reduce. Quiet where the
    script agrees on a step count (an all_reduce with ReduceOp.MIN, DDP's
    join()), or caps the loop with a break."""
    data = DataFlow(script)
    if not data.is_distributed or data.uses_framework or equalizes_steps(script):
        return
    if not meets_at_every_step(script):
        return
    for node in data.loader_calls:
        dataset = loader_dataset(node)
        if dataset is None or has_sampler(node):
            continue
        if not data.trains_on(node):
            continue
        repacked = data.shard_repacked(dataset)
        if repacked is not None:
            shard, recount = repacked
            yield script.finding(
                "uneven-inputs",
                node,
                f"DataLoader over {source_text(dataset)} reads this rank's shard "
                f"(`{source_text(shard.func)}(...)`, line {shard.lineno}), which "
                f"`.{recount.func.attr}(...)` (line {recount.lineno}) turns into a number of "
                "rows of its own (blocks packed from its documents, rows dropped), so ranks "
                "run different numbers of steps and the first to finish leaves the others "
                "waiting in DDP's gradient all-reduce; pack or filter before sharding (or "
                "shard the packed rows with a DistributedSampler), or agree on the step "
                "count (all_reduce it with ReduceOp.MIN and stop there)",
            )
            continue
        keyed = data.rows_keyed_to_the_rank(dataset)
        if keyed is not None:
            yield script.finding(
                "uneven-inputs",
                node,
                f"DataLoader over {source_text(dataset)} holds the rows whose key falls to "
                f"this rank (`{source_text(keyed)}`, line {keyed.lineno}): as many as the data "
                "holds for those keys, so ranks run different numbers of steps and the first "
                "to finish leaves the others waiting in DDP's gradient all-reduce; shard the "
                "rows evenly (a DistributedSampler), or agree on the step count (all_reduce "
                "it with ReduceOp.MIN and stop there) or use DDP's join()",
            )
            continue
        split = data.files_split_by_rank(dataset)
        if split is None or data.length_fixed_by_the_run(dataset):
            continue
        yield script.finding(
            "uneven-inputs",
            node,
            f"DataLoader over {source_text(dataset)} reads this rank's own share of "
            f"{source_text(split.value)} (`{source_text(split)}`, line {split.lineno}): "
            "its items (files, episodes, videos) hold different amounts of data, so ranks "
            "run different numbers of steps and the first to finish "
            "leaves the others waiting in DDP's gradient all-reduce; agree on the step "
            "count (all_reduce it with ReduceOp.MIN and stop there) or use DDP's join()",
        )


@check("uneven-inputs")
def check_training_on_examples_each_rank_makes(script: Script) -> Iterator[Finding]:
    """A DDP training loop over a loader of examples the rank makes itself in that loop
    (self-play games, episodes) in a loop that runs until the game ends: each rank has
    its own number of examples, hence of batches, and the rank with more runs a backward
    whose gradient all-reduce no other rank joins. Quiet where the script agrees on a
    step count (an all_reduce with ReduceOp.MIN, DDP's join())."""
    data = DataFlow(script)
    if not data.is_distributed or data.uses_framework or equalizes_steps(script):
        return
    if not any(is_ddp(name) for _, name in script.call_names):
        return
    for node in data.loader_calls:
        dataset = loader_dataset(node)
        if dataset is None or has_sampler(node) or not data.trains_on(node):
            continue
        maker = data.maker_in_its_training_loop(node, dataset)
        if maker is None:
            continue
        ending = data.made_until_an_end(dataset)
        if ending is None:
            continue
        yield script.finding(
            "uneven-inputs",
            node,
            f"DataLoader over {source_text(dataset)} holds the examples this rank makes in "
            f"its training loop ({source_text(maker.func)}(...), line {maker.lineno}), "
            f"collected until the `while` of line {ending.lineno} ends: each rank has its own "
            "number of examples and of batches, and the rank with more runs a backward whose "
            "gradient all-reduce no other rank joins; agree on the step count (all_reduce the "
            "number of batches with ReduceOp.MIN and stop there) or train under DDP's join()",
        )


def is_constant_true(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is True


def names_bound_inside(value: ast.expr) -> set[str]:
    """Names a comprehension's targets or a lambda's parameters bind within `value`."""
    local: set[str] = set()
    for node in walk(value):
        if isinstance(node, ast.comprehension):
            local |= {n.id for n in walk(node.target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Lambda):
            local |= {
                a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)
            }
    return local


def sampler_fix(script: Script, dataset: str) -> str:
    """How this script's launcher wants a loader split: Ray's and Composer's own way."""
    packages = {name.split(".")[0] for _node, name in script.call_names}
    if "ray" in packages:
        return "pass the loader through ray.train.torch.prepare_data_loader(...)"
    if "composer" in packages:
        return f"pass sampler=composer.utils.dist.get_sampler({dataset})"
    return f"pass sampler=DistributedSampler({dataset})"


# Wrappers that all-reduce the gradients in every backward (DeepSpeed's engine too).
GRADIENT_SYNCING_WRAPPERS = frozenset({"FullyShardedDataParallel", "fully_shard"})


def meets_at_every_step(script: Script) -> bool:
    """The ranks meet at each training step: a DDP or FSDP wrapper or DeepSpeed's engine
    syncs every backward, or a collective runs in a function that runs a backward (a
    hand-written gradient all-reduce, a loss averaged per step). Without one (federated
    clients each trained alone between two rounds' all_reduce), a rank with more batches
    only finishes later; it waits in no collective."""
    for node, name in script.call_names:
        if is_ddp(name) or short(name) in GRADIENT_SYNCING_WRAPPERS or name == DEEPSPEED_ENGINE:
            return True
        if is_collective(name):
            scope = enclosing_scope(node, script)
            if scope is not None and any(is_backward(n) or reads_gradients(n) for n in walk(scope)):
                return True
    return False


def reads_gradients(node: ast.AST) -> bool:
    """`p.grad`: a helper that all-reduces gradients by hand runs once per step."""
    return (
        isinstance(node, ast.Attribute) and node.attr == "grad" and isinstance(node.ctx, ast.Load)
    )


def equalizes_steps(script: Script) -> bool:
    """`dist.all_reduce(n, op=ReduceOp.MIN)`, DDP's `model.join()` or `Join([...])`."""
    for node in script.nodes:
        if isinstance(node, ast.Attribute) and node.attr == "MIN":
            return True
        if isinstance(node, ast.Call):
            called = called_name(node)
            # not os.path.join(a, b) or ", ".join(parts): DDP's join() takes no positional
            if called == "Join" or (called == "join" and not node.args):
                return True
    return False


@check("missing-distributed-sampler")
def check_own_sampler_not_split(script: Script) -> Iterator[Finding]:
    """A DataLoader whose sampler is the file's own Sampler class (a P x K identity
    sampler, a bucketing sampler) that never splits the indices by rank: every rank
    iterates the whole dataset, as with no sampler at all."""
    data = DataFlow(script)
    if not data.is_distributed or data.uses_framework:
        return
    for node in data.loader_calls:
        sampler = next(
            (k.value for k in node.keywords if k.arg in ("sampler", "batch_sampler")), None
        )
        built = data.own_sampler(sampler) if sampler is not None else None
        if built is None:
            continue
        dataset = loader_dataset(node)
        if dataset is not None and (data.may_be_iterable(dataset) or data.sharded_by_rank(dataset)):
            continue
        if data.rank_zero_only(node):
            continue
        name = called_name(built)
        if name in WHOLE_SET_SAMPLERS:
            message = (
                f"the DataLoader's sampler, {name}(...), draws from the whole dataset on every "
                "rank: each rank runs a full epoch of its own (N times the work, the same "
                "batches on every GPU when the ranks seed alike); draw num_samples // world_size "
                "per rank from a rank-seeded generator, or use a distributed weighted sampler "
                "(DistributedSampler over a weighted subset, or Catalyst's DistributedSamplerWrapper)"
            )
        else:
            message = (
                f"the DataLoader's sampler, {name}(...), is this file's own and never splits the "
                "indices by rank: every rank iterates the whole dataset (N times the work, the "
                "same batches on every GPU when the ranks seed alike); give it the rank and the "
                "number of replicas and keep every num_replicas-th index from rank, as "
                "DistributedSampler does"
            )
        yield script.finding("missing-distributed-sampler", node, message)


def has_sampler(loader: ast.Call) -> bool:
    """sampler= / batch_sampler= given (not None), by position, or maybe through */**."""
    for given in loader.keywords:
        if given.arg is None:  # **options may carry one
            return True
        if given.arg in ("sampler", "batch_sampler") and not is_none(given.value):
            return True
    return len(loader.args) > SAMPLER_POSITION or any(
        isinstance(arg, ast.Starred) for arg in loader.args
    )


def shuffles(loader: ast.Call) -> bool:
    """DataLoader(..., shuffle=True), by keyword or as the third positional argument."""
    value = keyword(loader, "shuffle")
    if value is None and len(loader.args) > SHUFFLE_POSITION:
        value = loader.args[SHUFFLE_POSITION]
    return isinstance(value, ast.Constant) and value.value is True


def seed_of(sampler: ast.Call) -> ast.expr | None:
    """DistributedSampler(..., seed=s) or its fifth positional argument."""
    given = keyword(sampler, "seed")
    if given is None and len(sampler.args) > SEED_POSITION:
        given = sampler.args[SEED_POSITION]
    return given


def is_none(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is None


def shuffle_off(sampler: ast.Call) -> bool:
    """DistributedSampler(..., shuffle=False): the epoch does not change its order."""
    value = keyword(sampler, "shuffle")
    return isinstance(value, ast.Constant) and value.value is False


Key = TypeVar("Key", bound=Hashable)
Answer = TypeVar("Answer")


def memoized(method: Callable[[DataFlow, Key], Answer]) -> Callable[[DataFlow, Key], Answer]:
    """A DataFlow method of one node (or name), worked out once per script.

    AST nodes hash by identity, so a node is its own key.
    """
    memo_name = f"_memo_{method.__name__}"

    @wraps(method)
    def once(self: DataFlow, key: Key) -> Answer:
        memo = self.__dict__.setdefault(memo_name, {})
        if key not in memo:
            memo[key] = method(self, key)
        return memo[key]

    return once


# Point-to-point ops between pipeline stages, and the collectives a tensor-parallel
# layer issues in its own forward / backward (an expert layer's all_to_all moves
# tokens of different data between replicas, so it is not one of them).
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp"})
TENSOR_PARALLEL_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
    }
)


def averages_a_gradient(node: ast.Call, name: str) -> bool:
    """`dist.all_reduce(p.grad)`: data parallelism written by hand."""
    if not is_dist_call(name, {"all_reduce", "reduce_scatter", "reduce_scatter_tensor"}):
        return False
    return any(
        isinstance(inner, ast.Attribute) and inner.attr == "grad"
        for argument in node.args[:2]
        for inner in walk(argument)
    )


WEIGHT_SOURCES = frozenset({"parameters", "named_parameters", "state_dict", "values", "items"})


def averages_weights(script: Script, node: ast.Call, name: str) -> bool:
    """`dist.all_reduce(p.data)`, or an all_reduce inside a loop over a model's
    parameters or state_dict (FedAvg, local SGD): the ranks train one model."""
    if not is_dist_call(name, {"all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce"}):
        return False
    if any(
        isinstance(inner, ast.Attribute) and inner.attr == "data"
        for argument in node.args[:1]
        for inner in walk(argument)
    ):
        return True
    loop = enclosing_loop(node, script.parents)
    while loop is not None:
        if isinstance(loop, ast.For) and any(
            isinstance(inner, ast.Call) and called_name(inner) in WEIGHT_SOURCES
            for inner in walk(loop.iter)
        ):
            return True
        loop = enclosing_loop(loop, script.parents)
    return False


@dataclass
class DataFlow:
    """What both checks ask of a script: its loaders, samplers, and where names come from."""

    script: Script

    @property
    def parents(self) -> dict[int, ast.AST]:
        return self.script.parents

    @cached_property
    def is_distributed(self) -> bool:
        """The script starts a process group or wraps a model in DDP, or trains
        with Composer's Trainer (`composer -n N`) or Ray Train's TorchTrainer,
        which run a process per GPU but leave the samplers to the script
        (composer.utils.dist.get_sampler, ray.train.torch.prepare_data_loader)."""
        return is_distributed(self.script) or calls_any(self.script, SCRIPT_SAMPLED_LAUNCHERS)

    @cached_property
    def data_parallel(self) -> bool:
        """A model wrapped for data parallelism (DDP, FSDP): the ranks are replicas that
        each need their own share, not pipeline stages that read the same batches."""
        return any(short(name) in TORCH_WRAPPERS for _node, name in self.script.call_names)

    @cached_property
    def independent_models(self) -> bool:
        """Each process trains a model of its own (a population member, a search
        trial): a process group and a backward, but no data-parallel wrapper, no
        DeepSpeed engine, no gradients or weights averaged by hand. Every rank reading
        the whole dataset is then the point, not N times the work. (Without a
        backward, ranks that read the same data share one job, an embedding pass
        whose outputs they gather, and each does all of it.)"""
        if not is_distributed(self.script) or self.data_parallel or self.model_parallel_only:
            return False
        if not any(is_backward(node) for node, _name in self.script.call_names):
            return False
        if calls_any(self.script, {("deepspeed", "initialize")} | SCRIPT_SAMPLED_LAUNCHERS):
            return False
        return not any(
            averages_a_gradient(node, name) or averages_weights(self.script, node, name)
            for node, name in self.script.call_names
        )

    @cached_property
    def model_parallel_only(self) -> bool:
        """The ranks hold parts of one model and no rank is a replica: pipeline
        stages passing activations (send / recv, batch_isend_irecv) or tensor-
        parallel layers whose forward / backward all-reduce or all-gather, with
        no data-parallel wrapper and no gradients averaged by hand. Every rank
        must then read the same batches: a DistributedSampler would be the mistake."""
        if self.data_parallel or calls_any(self.script, {("deepspeed", "initialize")}):
            return False
        if any(averages_a_gradient(node, name) for node, name in self.script.call_names):
            return False
        # Named, not only called: `p2p(dist.isend, tensor, peer)` hands the op to a helper.
        return any(
            isinstance(node, ast.Name | ast.Attribute)
            and is_dist_call(self.script.name_of(node), POINT_TO_POINT)
            for node in self.script.nodes
        ) or any(
            is_dist_call(self.script.name_of(node.func), TENSOR_PARALLEL_COLLECTIVES)
            for qualified, function in self.script.functions.items()
            if qualified.rpartition(".")[2] in ("forward", "backward")
            for node in walk(function)
            if isinstance(node, ast.Call)
        )

    @cached_property
    def mentions_distributed_sampler(self) -> bool:
        """Any name with "distributed" and "sampler" in it: torch's, or the script's own."""
        for node in self.script.nodes:
            if isinstance(node, ast.Name):
                word = node.id
            elif isinstance(node, ast.Attribute):
                word = node.attr
            elif isinstance(node, (ast.alias, ast.ClassDef)):
                word = node.name
            else:
                continue
            if "distributed" in word.lower() and "sampler" in word.lower():
                return True
        return False

    @cached_property
    def own_samplers(self) -> dict[str, ast.ClassDef]:
        """The file's Sampler classes (a base named like `...Sampler`) whose code, with
        their same-file bases', never reads a rank, a world size or a replica count."""
        classes = {n.name: n for n in self.script.nodes if isinstance(n, ast.ClassDef)}
        found = {}
        for name, cls in classes.items():
            lineage, pending = [], [cls]
            while pending and len(lineage) < MAX_LINEAGE:
                current = pending.pop()
                lineage.append(current)
                pending += [
                    classes[b.id]
                    for b in current.bases
                    if isinstance(b, ast.Name) and b.id in classes
                ]
            bases = {called_name_of(b) for c in lineage for b in c.bases}
            if not any(base.endswith("Sampler") for base in bases):
                continue
            if any(SPLIT_WORDS.search(word) for c in lineage for word in words_in(c)):
                continue
            found[name] = cls
        return found

    def own_sampler(self, sampler: ast.expr) -> ast.Call | None:
        """The call building `sampler` (itself, or every value of the name it is) when it
        builds one of own_samplers, or one of torch's WHOLE_SET_SAMPLERS, with no argument
        that reads a rank (itself, or the generator it is given); else None."""
        values = (
            self.script.assigned_values.get(sampler.id, [])
            if isinstance(sampler, ast.Name)
            else [sampler]
        )
        calls = [v for v in values if isinstance(v, ast.Call)]
        if not calls or len(calls) != len(values):
            return None
        known = {*self.own_samplers, *(WHOLE_SET_SAMPLERS if self.data_parallel else ())}
        if any(called_name(c) not in known for c in calls):
            # `if args.weighted: WeightedRandomSampler(...) else: DistributedSampler(...)`:
            # an option's branch draws the whole set on every rank; a branch for a run of
            # one process (`if not args.distributed:`) is that run's own
            calls = [c for c in calls if called_name(c) in known and self.picked_by_an_option(c)]
            if not calls:
                return None
        if any(SPLIT_WORDS.search(word) for c in calls for word in words_in(c)):
            return None
        if any(self.wraps_a_split_sampler(c) for c in calls):
            return None  # `GroupedBatchSampler(train_sampler, ...)` of a DistributedSampler
        # a generator made for this rank: `g = torch.Generator().manual_seed(seed + rank)`,
        # then `WeightedRandomSampler(w, n, generator=g)` draws this rank's own samples
        generators = [keyword(c, "generator") for c in calls]
        if any(
            SPLIT_WORDS.search(word)
            for given in generators
            if isinstance(given, ast.Name)
            for value in self.script.assigned_values.get(given.id, [])
            for word in words_in(value)
        ):
            return None
        return calls[0]

    def wraps_a_split_sampler(self, call: ast.Call) -> bool:
        """The sampler is given one whose making splits by rank (a name assigned a
        DistributedSampler): it batches or groups that rank's share."""
        return any(
            isinstance(value, ast.Call)
            and called_name(value).endswith("Sampler")
            and SPLIT_WORDS.search(called_name(value))
            for argument in call.args
            if isinstance(argument, ast.Name)
            for value in self.script.assigned_values.get(argument.id, [])
        )

    def picked_by_an_option(self, call: ast.Call) -> bool:
        """The `if` whose branch builds `call` tests something other than whether the run
        is distributed (its world size, rank, a distributed flag)."""
        child, parent = call, self.parents.get(id(call))
        while parent is not None and not isinstance(parent, ast.FunctionDef | ast.Module):
            if isinstance(parent, ast.If | ast.IfExp) and child is not parent.test:
                return not DISTRIBUTED_TEST.search(full_text(parent.test))
            child, parent = parent, self.parents.get(id(parent))
        return False

    @cached_property
    def uses_framework(self) -> bool:
        return any(imports_package(self.script, package) for package in SAMPLER_FRAMEWORKS)

    @cached_property
    def set_epoch_calls(self) -> list[ast.Call]:
        """Every `.set_epoch(...)`: on the sampler, `loader.sampler`, or a wrapper of either."""
        return [
            node
            for node, name in self.script.call_names
            if short(name) == "set_epoch" or is_method(node, "set_epoch")
        ]

    @cached_property
    def loader_calls(self) -> list[ast.Call]:
        """torch's DataLoader, and the subclasses that take its arguments
        (PyTorch Geometric's, MONAI's, the file's own: a BasicSR-style
        PrefetchDataLoader(DataLoader)): they shard nothing by themselves."""
        own = own_loader_classes(self.script)
        return [
            node
            for node, name in self.script.call_names
            if (short(name) == "DataLoader" and name.startswith(LOADER_PACKAGES))
            or (name in own and takes_the_dataset_first(own[name], node))
        ]

    @cached_property
    def sampler_calls(self) -> list[ast.Call]:
        return self.torch_calls("DistributedSampler")

    def torch_calls(self, class_name: str) -> list[ast.Call]:
        """Calls of torch's `class_name` (torch.utils.data.X, however imported)."""
        return [
            node
            for node, name in self.script.call_names
            if short(name) == class_name and name.startswith("torch.")
        ]

    @cached_property
    def assignments(self) -> dict[str, list[ast.expr]]:
        """Name (or `self.` attribute name) -> every value assigned to it in the file."""
        values: dict[str, list[ast.expr]] = {}
        for node in self.script.nodes:
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            else:
                continue
            for target, value in pairs:
                # `me, world = get_rank(), get_world_size()`: each name its own element
                for name, element in paired(target, value):
                    values.setdefault(name, []).append(element)
        return values

    @cached_property
    def field_assignments(self) -> dict[str, list[ast.expr]]:
        """`self.` attribute name -> every value assigned to it as a field in the file."""
        values: dict[str, list[ast.expr]] = {}
        for node in self.script.of_type((ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is None:
                continue
            for target in targets:
                for name, element in paired_fields(target, node.value):
                    values.setdefault(name, []).append(element)
        return values

    @cached_property
    def reads(self) -> dict[str, list[ast.AST]]:
        """Name (or `self.` attribute name) -> every node that reads it."""
        found: dict[str, list[ast.AST]] = {}
        for node in self.script.nodes:
            name = read_name(node)
            if name is not None and isinstance(getattr(node, "ctx", None), ast.Load):
                found.setdefault(name, []).append(node)
        return found

    @cached_property
    def handed_to_preparers(self) -> tuple[set[int], set[str]]:
        """Expressions passed to `accelerator.prepare(...)` and the like: ids, and names read."""
        ids: set[int] = set()
        names: set[str] = set()
        for node, _name in self.script.call_names:
            func = node.func
            if not (isinstance(func, ast.Attribute) and func.attr in PREPARERS):
                continue
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                ids.add(id(arg))
                name = read_name(arg)
                if name is not None:
                    names.add(name)
        return ids, names

    @cached_property
    def rank_paths(self) -> dict[int, list[RankPath]]:
        """Each traced call's rank branches, once per trace that reaches it."""
        paths: dict[int, list[RankPath]] = {}
        for trace in self.script.traces:
            for call in trace:
                paths.setdefault(id(call.node), []).append(call.rank_path)
        return paths

    @cached_property
    def iterable_classes(self) -> set[str]:
        """Classes of this file that are IterableDatasets, directly or through one another."""
        classes = [n for n in self.script.tree.body if isinstance(n, ast.ClassDef)]
        found: set[str] = set()
        changed = True
        while changed:
            changed = False
            for cls in classes:
                bases = {short(self.script.name_of(base)) for base in cls.bases}
                if cls.name not in found and bases & (ITERABLE_BASES | found):
                    found.add(cls.name)
                    changed = True
        return found

    # -------------------------------------------------------------- where a value comes from

    def origin(self, expr: ast.expr, through_parameters: bool = False) -> list[ast.expr]:
        """`expr` and the values assigned to the names in it, a few assignments back;
        a loop variable's values come from what its loop iterates
        (`for cid in my_clients`: `Subset(ds, idx[cid])` is cut as my_clients is).
        `through_parameters`: a parameter of the function is followed to what the
        file's calls pass for it (passed_for)."""
        found: dict[int, ast.expr] = {id(expr): expr}
        frontier = [expr]
        # Only the parameters of the function `expr` is in: past its callers, another
        # function's parameters would take the values of every call of it.
        home = self.enclosing_function(expr) if through_parameters else None
        for _ in range(ORIGIN_DEPTH):
            assigned = (
                value
                for current in frontier
                for at_home in [home is not None and self.enclosing_function(current) is home]
                for name in [
                    *self.assigned_names_in(current),
                    *(self.parameters_read_in(current) if at_home else ()),
                ]
                for value in [
                    *self.assignments_seen_from(current, name),
                    *self.loop_sources_seen_from(current, name),
                    *self.appended_seen_from(current, name),
                    *self.comprehension_sources_around(current, name),
                    *self.returned_to.get(name, ()),
                    *(self.passed_for(current, name) if at_home else ()),
                ]
                if id(value) not in found
            )
            assigned = chain(assigned, self.returned_inline(frontier, found))
            # The first few only: a name assigned thousands of times is not a dataset's.
            frontier = list(islice(assigned, MAX_ORIGINS))
            found.update((id(v), v) for v in frontier)
            if len(found) > MAX_ORIGINS:
                break
        return list(found.values())

    def passed_for(self, node: ast.AST, name: str) -> list[ast.expr]:
        """What the file's calls of the function around `node` pass for its parameter
        `name`, which the function does not reassign (`validate(net, va_ds)` for
        `def validate(net, val_ds)`: the loader there is over what the caller cut)."""
        function = self.enclosing_function(node)
        if function is None or name not in parameter_names(function):
            return []
        if self.scope_assignments(function).get(name):
            return []
        method = isinstance(self.parents.get(id(function)), ast.ClassDef)
        return [
            argument
            for call in self.callers.get(id(function), [])
            for parameter, argument in bound_arguments(function, call, self_bound=method)
            if parameter == name
        ]

    def assignments_seen_from(self, node: ast.AST, name: str) -> list[ast.expr]:
        """The values `name` is assigned where `node` reads it: the function's own
        when it assigns the name (another function's `n` or `lo` is not this one's),
        else the file's (a parameter's callers, a closure's outer function, a field)."""
        every = self.assignments.get(name, [])
        if not every or not any(isinstance(n, ast.Name) and n.id == name for n in walk(node)):
            # read as a field (`self.vids`): the class's, not another function's local
            # `vids` (an evaluation's `vids = ids[rank::world]`); all of them only where
            # the file never assigns the field as `self.vids` (it came from elsewhere)
            return self.field_assignments.get(name) or every
        scope = enclosing_scope(node, self.script)
        if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            return every
        local = self.scope_assignments(scope).get(name)
        return local if local else every

    @memoized
    def scope_assignments(self, scope: ast.AST) -> dict[str, list[ast.expr]]:
        """Name -> the values a function's own statements bind it to: assignments,
        `with ... as name` (the context's value), a loop's variable (what it iterates)."""
        values: dict[str, list[ast.expr]] = {}
        for node in self.script.scope_nodes(scope):
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.With | ast.AsyncWith):  # `with open(p) as f`: f is local
                pairs = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars]
            elif isinstance(node, ast.For | ast.AsyncFor):  # the loop's items
                pairs = [(node.target, node.iter)]
            else:
                continue
            for target, value in pairs:
                # plain names only: `self.keys = ...` is the object's field, not a local
                plain = {n.id for n in walk(target) if isinstance(n, ast.Name)}
                for each, element in paired(target, value):
                    if each in plain:
                        values.setdefault(each, []).append(element)
        return values

    @cached_property
    def returned_to(self) -> dict[str, list[ast.expr]]:
        """Name -> what the file's function returns into it where the name is
        assigned its call: `ds = build(root)` takes each `return` value,
        `train_ds, n = load_my_parts(root, rank, world)` the element of a returned
        tuple at its place (the dataset built from `files[rank::world]`, not the
        count beside it; `rank, world = setup()` the rank, not the world size)."""
        found: dict[str, list[ast.expr]] = {}
        for node in self.script.nodes:
            if not (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and (function := self.script.functions.get(node.value.func.id)) is not None
            ):
                continue
            target = node.targets[0]
            for returned in self.return_values(function):
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(returned)
                elif (
                    isinstance(target, ast.Tuple)
                    and isinstance(returned, ast.Tuple)
                    and len(returned.elts) == len(target.elts)
                ):
                    for name, element in zip(target.elts, returned.elts, strict=True):
                        if isinstance(name, ast.Name):
                            found.setdefault(name.id, []).append(element)
        return found

    def returned_inline(
        self, frontier: list[ast.expr], found: dict[int, ast.expr]
    ) -> Iterator[ast.expr]:
        """What the file's functions return where a value calls one in place
        (`NeighborLoader(data, input_nodes=shard(idx))`, `def shard(idx): return
        idx[rank * n:(rank + 1) * n]`), and what the __init__ of a class of the
        file it builds keeps (`self.keys = keys[rank::world]`); a returned tuple only
        through the names its call is assigned to (returned_to), element by element."""
        for current in frontier:
            for node in walk(current):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                function = self.script.functions.get(node.func.id)
                init = self.script.functions.get(f"{node.func.id}.__init__")
                if function is not None:
                    values = self.return_values(function)
                elif init is not None:
                    values = self.fields_set_in(init)  # `self.keys = keys[rank::world]`
                else:
                    continue
                for value in values:
                    if not isinstance(value, ast.Tuple) and id(value) not in found:
                        yield value

    @memoized
    def fields_set_in(self, init: ast.AST) -> list[ast.expr]:
        """What a class's __init__ assigns to its own fields (`self.x = ...`)."""
        return [
            node.value
            for node in own_nodes(init)
            if isinstance(node, ast.Assign)
            and any(self_attribute(target) for target in node.targets)
        ]

    @memoized
    def return_values(self, function: ast.AST) -> list[ast.expr]:
        """The values of a function's own `return` statements (not its inner functions')."""
        return [
            node.value
            for node in own_nodes(function)
            if isinstance(node, ast.Return) and node.value is not None
        ]

    @memoized
    def assigned_names_in(self, value: ast.expr) -> list[str]:
        """The names read in `value` that the file assigns to or loops over; not
        those a comprehension or lambda in `value` binds itself (`t` in `[t for
        _, t in items]` is not the file's other `t`s)."""
        bound = self.assignments.keys() | self.loop_names | self.comprehension_sources.keys()
        local = names_bound_inside(value)
        return [
            name
            for name in map(read_name, outside_placements(self.script, value))
            if name in bound and name not in local
        ]

    @memoized
    def parameters_read_in(self, value: ast.expr) -> list[str]:
        """The parameters of `value`'s function that it reads (passed_for follows them
        to what the file's calls pass)."""
        function = self.enclosing_function(value)
        if function is None:
            return []
        parameters = parameter_names(function) - names_bound_inside(value)
        return [
            name
            for name in map(read_name, outside_placements(self.script, value))
            if name in parameters
        ]

    @cached_property
    def loop_names(self) -> set[str]:
        """The names the file's loops bind, in any function."""
        return {name for _function, name in self.loop_sources_by_function}

    @cached_property
    def appended_to(self) -> dict[tuple[int, str], list[ast.expr]]:
        """(id of the function, list name) of a list built by appending
        (`parts.append(AssetWindows(df, aid))`, `parts.extend(...)`, `parts += ...`) -> the values
        appended: `ConcatDataset(parts)` is made of them, and of what their loop
        iterates. By function: another function's `records` is another list."""
        appended: dict[tuple[int, str], list[ast.expr]] = {}
        for node in self.script.of_type(ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("append", "extend")
                and isinstance(func.value, ast.Name)
                and len(node.args) == 1
            ):
                key = (id(self.enclosing_function(node)), func.value.id)
                appended.setdefault(key, []).append(node.args[0])
        for node in self.script.of_type(ast.AugAssign):  # `fresh += self_play(mcts)`
            if isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
                key = (id(self.enclosing_function(node)), node.target.id)
                appended.setdefault(key, []).append(node.value)
        return appended

    @cached_property
    def loop_sources_by_function(self) -> dict[tuple[int, str], list[ast.expr]]:
        """(id of the function, name) of a loop variable (`for cid in my_clients`,
        `for aid, t in mine`) -> what its loops iterate. By function: the `pid` of a
        sampler's loop over its batches is not the `pid` a reader parses from a file
        name, nor the `i` of every `for i, x in enumerate(...)` one."""
        sources: dict[tuple[int, str], list[ast.expr]] = {}
        for node in self.script.of_type(ast.For):
            function = id(self.enclosing_function(node))
            for target in walk(node.target):
                if isinstance(target, ast.Name):
                    sources.setdefault((function, target.id), []).append(node.iter)
        return sources

    def loop_sources_seen_from(self, node: ast.AST, name: str) -> list[ast.expr]:
        """What the loops of the function around `node` that bind `name` iterate."""
        return self.loop_sources_by_function.get((id(self.enclosing_function(node)), name), [])

    def appended_seen_from(self, node: ast.AST, name: str) -> list[ast.expr]:
        """What the function around `node` appends to its list `name` (appended_to)."""
        return self.appended_to.get((id(self.enclosing_function(node)), name), [])

    @cached_property
    def comprehension_sources(self) -> dict[str, list[tuple[ast.expr, ast.expr]]]:
        """A comprehension's plain variable -> (the comprehension, what it iterates).
        Python binds it inside the comprehension only: `[read(f) for f in mine]`
        says nothing of main's `with open(path) as f`."""
        sources: dict[str, list[tuple[ast.expr, ast.expr]]] = {}
        for node in self.script.nodes:
            if isinstance(node, COMPREHENSIONS):
                for generator in node.generators:
                    if isinstance(generator.target, ast.Name):
                        entry = (node, generator.iter)
                        sources.setdefault(generator.target.id, []).append(entry)
        return sources

    def comprehension_sources_around(self, expr: ast.expr, name: str) -> list[ast.expr]:
        """What `name` iterates in the comprehensions that hold `expr`."""
        held = self.comprehension_sources.get(name)
        if not held:
            return []
        around = set()
        node = self.script.parents.get(id(expr))
        while node is not None:
            around.add(id(node))
            node = self.script.parents.get(id(node))
        return [iterated for comprehension, iterated in held if id(comprehension) in around]

    def may_be_iterable(self, dataset: ast.expr) -> bool:
        """An instance of an IterableDataset class of this file, or a stream (streaming=True)."""
        return any(map(self.value_builds_iterable, self.origin(dataset)))

    @memoized
    def value_builds_iterable(self, value: ast.expr) -> bool:
        return any(isinstance(n, ast.Call) and self.builds_iterable(n) for n in walk(value))

    def builds_iterable(self, call: ast.Call) -> bool:
        """`load_dataset(..., streaming=True)`, `Stream()` of an IterableDataset class of the
        file, or a same-file function that builds one."""
        if keyword(call, "streaming") is not None or self.constructs_iterable_class(call):
            return True
        return any(
            callee.split(".")[0] in self.iterable_classes or callee in self.iterable_builders
            for callee in same_file_callees(self.script, call.func, None)
        )

    def constructs_iterable_class(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in self.iterable_classes
        )

    @cached_property
    def iterable_builders(self) -> set[str]:
        """Same-file functions that build one of the file's IterableDatasets (each walked once)."""
        if not self.iterable_classes:
            return set()
        return {
            name
            for name, function in self.script.functions.items()
            if any(map(self.constructs_iterable_class, walk(function)))
        }

    def sharded_by_rank(self, dataset: ast.expr) -> bool:
        """The dataset is cut per rank already: `Subset(ds, idx[rank::world])`, `.shard(...)`;
        a rank tested against a constant (`download=(rank == 0)`) cuts nothing."""
        return any(
            self.splits_itself(value)
            or (
                self.value_indexes_by_rank(value)
                # the rank's making (dist.get_rank(), int(os.environ["RANK"]))
                and not is_rank_expr(without_int(value), self.script)
                and not self.helper_only_compares_rank(value)
            )
            for value in self.origin(dataset, through_parameters=True)
        )

    def splits_itself(self, value: ast.expr) -> bool:
        """A dataset class that partitions its samples over the ranks itself
        (mosaicml-streaming's StreamingDataset reads RANK / WORLD_SIZE)."""
        return isinstance(value, ast.Call) and self.script.name_of(value.func).startswith(
            SELF_SPLITTING_PACKAGES
        )

    def helper_only_compares_rank(self, value: ast.expr) -> bool:
        """`get_datasets(root, rank)`: a function of this file that only compares the
        rank it is given (`if rank != 0: dist.barrier()`, `download=(rank == 0)`)."""
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
            return False
        function = self.script.functions.get(value.func.id)
        if function is None:
            return False
        rank_parameters = [
            parameter
            for parameter, argument in bound_arguments(function, value)
            if self.value_reads_rank(argument)
        ]
        if None in rank_parameters:
            return False  # into *args or **kwargs: cannot tell
        to_samplers = ranks_given_to_samplers(self.script, function)
        return bool(rank_parameters) and all(
            only_compared(function, name, also=to_samplers) for name in rank_parameters
        )

    def rows_keyed_to_the_rank(self, dataset: ast.expr) -> ast.Compare | None:
        """`train[train[:, 0] % world == rank]`: the rows a mask keeps by a key of the
        data (a head entity, a user id) taken modulo the world size; not by the row's
        own position (`np.arange(n) % world == rank` deals out evenly)."""
        for value in self.origin(dataset):
            for node in walk(value):
                if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Compare)):
                    continue
                mask = node.slice
                if not (len(mask.ops) == 1 and isinstance(mask.ops[0], ast.Eq)):
                    continue
                for keyed, rank in (
                    (mask.left, mask.comparators[0]),
                    (mask.comparators[0], mask.left),
                ):
                    if (
                        isinstance(keyed, ast.BinOp)
                        and isinstance(keyed.op, ast.Mod)
                        and any(PROCESS_COUNT.search(n) for n in names_in(keyed.right))
                        and self.value_reads_rank(rank)
                        and isinstance(keyed.left, ast.Subscript | ast.Attribute)
                    ):
                        return mask
        return None

    def files_split_by_rank(self, dataset: ast.expr) -> ast.Subscript | None:
        """`files[rank::world]` in the dataset's making, where `files` is a list of
        files (glob, listdir, a name with "file" or "shard" in it), or a list whose
        items a dataset class of the file expands into samples of their own number."""
        origin = self.origin(dataset)
        for value in origin:
            for node in walk(value):
                if self.strides_from_the_rank(node) and (
                    self.lists_files(node.value) or self.expanded(origin, node)
                ):
                    return node
        return None

    def strides_from_the_rank(self, node: ast.AST) -> TypeGuard[ast.Subscript]:
        """`items[rank::step]`: a slice that starts where the rank says and steps."""
        return (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Slice)
            and node.slice.step is not None
            and node.slice.lower is not None
            and self.value_reads_rank(node.slice.lower)
        )

    def expanded(self, origin: list[ast.expr], share: ast.Subscript) -> bool:
        """A dataset class of the file built from the share (or a name holding it) whose
        __init__ walks that parameter and, for each item, a loop of its own that collects
        samples (`for o in objs: for frame in meta["frames"]: self.items.append(...)`):
        each item holds as many samples as its own data."""
        held = {
            target.id
            for node in self.script.nodes
            if isinstance(node, ast.Assign) and node.value is share
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for value in origin:
            for call in walk(value):
                if self.dataset_per_item(call, share, held):
                    return True
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                    continue
                init = self.script.functions.get(f"{call.func.id}.__init__")
                if init is None:
                    continue
                given = {
                    parameter
                    for parameter, argument in bound_arguments(init, call, self_bound=True)
                    if argument is share or (isinstance(argument, ast.Name) and argument.id in held)
                }
                if any(expands_each_item(init, parameter) for parameter in given if parameter):
                    return True
        return False

    def dataset_per_item(self, node: ast.AST, share: ast.Subscript, held: set[str]) -> bool:
        """`ConcatDataset([ScenePairs(root, s) for s in my_scenes])`: a dataset of the
        file's own (one with a __len__) built for each item of the share, so each item
        holds as many samples as its own data."""
        if not (isinstance(node, ast.ListComp | ast.GeneratorExp) and len(node.generators) == 1):
            return False
        items = node.generators[0].iter
        if not (items is share or (isinstance(items, ast.Name) and items.id in held)):
            return False
        built = node.elt
        return (
            isinstance(built, ast.Call)
            and isinstance(built.func, ast.Name)
            and f"{built.func.id}.__len__" in self.script.functions
        )

    def length_fixed_by_the_run(self, dataset: ast.expr) -> bool:
        """A dataset class of the file whose __len__ returns a field its __init__ keeps
        from a parameter the construction gives a count that reads no data (`n =
        args.steps * args.batch`): as many samples on every rank, whatever its share."""
        for value in self.origin(dataset):
            for call in walk(value):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                    continue
                init = self.script.functions.get(f"{call.func.id}.__init__")
                length = self.script.functions.get(f"{call.func.id}.__len__")
                if init is None or length is None:
                    continue
                returned = [n.value for n in walk(length) if isinstance(n, ast.Return)]
                if len(returned) != 1 or (field := self_attribute(returned[0])) is None:
                    continue
                kept = kept_parameter(init, field)
                arguments = dict(bound_arguments(init, call, self_bound=True))
                if kept is not None and kept in arguments and self.is_a_count(arguments[kept]):
                    return True
        return False

    def is_a_count(self, expr: ast.expr) -> bool:
        """A number the run sets, not one read off data: constants, options, their
        arithmetic (`args.steps_per_epoch * args.batch`), names the file gives such
        values; no call (len(), a loader) nor an item read off a container."""
        bases = {id(n.value) for n in walk(expr) if isinstance(n, ast.Attribute)}
        named = {n.id for n in walk(expr) if isinstance(n, ast.Name) and id(n) not in bases}
        values = [expr]  # `args.steps`: an option; `n_rows`: what the file gives it
        values += [v for name in sorted(named) for v in self.script.assigned_values.get(name, [])]
        return not any(isinstance(n, ast.Call | ast.Subscript) for v in values for n in walk(v))

    def shard_repacked(self, dataset: ast.expr) -> tuple[ast.Call, ast.Call] | None:
        """(the `.shard(num_shards=world, index=rank)` call, the batched `.map` or the
        `.filter` after it) in the dataset's making: each rank turns its own share into
        a number of rows of its own (blocks packed from its documents, rows dropped)."""
        origin = self.origin(dataset)
        calls = [node for value in origin for node in walk(value) if isinstance(node, ast.Call)]
        shard = next(
            (
                call
                for call in calls
                if isinstance(call.func, ast.Attribute)
                and call.func.attr == "shard"
                and any(
                    self.value_reads_rank(a)
                    for a in [*call.args, *(k.value for k in call.keywords)]
                )
            ),
            None,
        )
        if shard is None:
            return None
        recount = next(
            (
                call
                for call in calls
                if isinstance(call.func, ast.Attribute)
                and (call.end_lineno, call.end_col_offset)
                > (shard.end_lineno, shard.end_col_offset)
                and (
                    call.func.attr == "filter"
                    or (call.func.attr == "map" and is_constant_true(keyword(call, "batched")))
                )
            ),
            None,
        )
        return (shard, recount) if recount is not None else None

    def lists_files(self, expr: ast.expr) -> bool:
        for value in self.origin(expr):
            for node in walk(value):
                name = read_name(node) or ""
                if FILE_LIST.search(name):
                    return True
                if isinstance(node, ast.Call) and short(self.script.name_of(node.func)) in (
                    "glob",
                    "iglob",
                    "listdir",
                    "rglob",
                ):
                    return True
        return False

    def unsplit_training_stream(self, loader: ast.Call, dataset: ast.expr) -> bool:
        """A training loader over a stream that nothing in its making splits by rank.

        Training: the stream is shuffled, or a loop over the loader runs backward.
        Split: a name of splitting or of the rank in its making
        (`split_dataset_by_node`, `.shard(...)`, `sharding_filter`, `rank`), or
        in the code of a same-file IterableDataset class it builds.
        """
        if self.rank_zero_only(loader):
            return False
        origin = self.origin(dataset)
        names = {name for value in origin for name in identifiers(value)}
        for value in origin:
            for node in walk(value):
                if self.constructs_iterable_class(node):
                    names |= identifiers(self.classes[node.func.id])
        if any(STREAM_SPLIT_WORDS.search(name) for name in names):
            return False
        return "shuffle" in names or self.trains_on(loader, capped=True)

    @cached_property
    def classes(self) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in self.script.tree.body if isinstance(n, ast.ClassDef)}

    def only_scored(self, loader: ast.Call) -> bool:
        """Every use of the loader is known and none trains: it is handed only to
        the file's own functions, whose loops over it run no backward (a
        BatchNorm recalibration for SWA weights, a calibration pass), and which do
        not yield its batches on (`def batches(loader): while True: yield from
        loader`, whose caller trains)."""
        names = set(self.names_bound_to(loader))
        uses = [
            (node, position)
            for node in self.script.nodes
            if isinstance(node, ast.Call)
            for position, arg in enumerate(node.args)
            if read_name(arg) in names and arg is not loader
        ]
        if not names or not uses or self.trains_on(loader):
            return False
        for call, position in uses:
            function = self.script.functions.get(read_name(call.func) or "")
            if function is None:
                return False  # handed to a framework or an import: it may train
            parameters = function.args.posonlyargs + function.args.args
            if position >= len(parameters) or loops_with_backward(function):
                return False
            if any(isinstance(n, ast.Yield | ast.YieldFrom) for n in own_nodes(function)):
                return False  # a generator hands the batches on to the loop that trains
        return True

    def made_by_its_own_training_loop(self, loader: ast.Call, dataset: ast.expr) -> bool:
        """Examples the process makes itself, in the loop that trains on them, under a
        random seed of its own rank: `for it in range(iters): games.append(play(net));
        ds = TensorDataset(...games...); for x, y in DataLoader(ds, shuffle=True): ...
        backward()` (self-play, rollouts). Each rank's data is its own already; there is
        nothing for a sampler to split."""
        from assistant.lint.checks.splits import seeds  # splits imports data

        return self.maker_in_its_training_loop(loader, dataset) is not None and bool(
            seeds(self.script)[1]
        )

    def maker_in_its_training_loop(self, loader: ast.Call, dataset: ast.expr) -> ast.Call | None:
        """The call of the file's own function, in the loop around the loader that also
        trains, that makes the loader's examples (`fresh += self_play(mcts)`) without
        reading files; None when the data is not made there."""
        loop = enclosing_loop(loader, self.parents)
        if loop is None or not any(is_backward(n) for n in walk(loop)):
            return None
        inside = {id(n) for n in walk(loop)}
        return next(
            (
                call
                for value in self.origin(dataset)
                if id(value) in inside
                for call in walk(value)
                if isinstance(call, ast.Call)
                and (function := self.script.function_called(call)) is not None
                and not self.reads_files(function)
            ),
            None,
        )

    def reads_files(self, function: ast.AST) -> bool:
        """The function lists or reads files (`glob`, `listdir`, `open`, `np.load`):
        what it returns was written by someone else, not made here."""
        return any(
            isinstance(node, ast.Call) and short(self.script.name_of(node.func)) in FILE_READS
            for node in walk(function)
        )

    def made_until_an_end(self, dataset: ast.expr) -> ast.While | None:
        """A `while` loop that makes the dataset's items (`while not state.is_terminal():
        hist.append(...)`): a game or an episode that ends when it ends, so the number
        of items is its own."""
        origin = self.origin(dataset)
        appended = [  # one step past the origin's depth: `return [... for o in hist]`
            item
            for value in origin
            for name in names_in(value)
            for item in self.appended_seen_from(value, name)
        ]
        for value in [*origin, *appended]:
            parent = self.parents.get(id(value))
            while parent is not None and not isinstance(
                parent, ast.FunctionDef | ast.AsyncFunctionDef
            ):
                if isinstance(parent, ast.While):
                    return parent
                parent = self.parents.get(id(parent))
        return None

    def read_into_memory(self, loader: ast.Call) -> bool:
        """Every read of the loader collects its batches (`[(x, y) for x, y in loader]`,
        `list(loader)`) into a table a sampler of the file's own then draws from (an
        episodic task sampler keeping the images in RAM): no pass that trains."""
        names = set(self.names_bound_to(loader))
        reads = (
            [loader]
            if not names
            else [
                node
                for node in self.script.nodes
                if isinstance(node, (ast.Name, ast.Attribute))
                and isinstance(node.ctx, ast.Load)
                and source_text(node) in names
            ]
        )
        return bool(reads) and all(self.collected(read) for read in reads)

    def collected(self, read: ast.expr) -> bool:
        """The batches kept as they come: a comprehension whose items call nothing
        (`(x, y)`, not `loss(model(x), y)`), or list() / tuple() of the loader. Items
        moved as they are kept (`[x.to(device) for x, _ in loader]`, the images of a
        BatchNorm recalibration) are kept too, unless a loop over the table trains."""
        parent = self.parents.get(id(read))
        if isinstance(parent, ast.comprehension) and parent.iter is read:
            comprehension = self.parents.get(id(parent))
            items = [getattr(comprehension, f, None) for f in ("elt", "key", "value")]
            calls = [n for item in items if item for n in walk(item) if isinstance(n, ast.Call)]
            if not calls:
                return True
            moves = all(isinstance(c.func, ast.Attribute) and c.func.attr in MOVES for c in calls)
            return moves and not self.trained_over(comprehension)
        return (
            isinstance(parent, ast.Call)
            and read_name(parent.func) in ("list", "tuple")
            and parent.args == [read]
        )

    def trained_over(self, table: ast.expr) -> bool:
        """A loop with a backward over a name the table is bound to (or a field of that
        name, `self.batches`), or a file function it is handed to that loops with one."""
        names = set(self.names_bound_to(table))
        if not names:
            return True  # a table no name holds: where it goes is not followed
        if self.trains_on(table, capped=True):
            return True
        return any(
            loops_with_backward(function)
            for node in self.script.nodes
            if isinstance(node, ast.Call) and any(read_name(a) in names for a in node.args)
            for function in [self.script.functions.get(read_name(node.func) or "")]
            if function is not None
        )

    def trains_on(self, loader: ast.Call, capped: bool = False) -> bool:
        """A `for ... in loader` loop (by a name bound to it) with a backward in it;
        one a `break` caps counts only when `capped`."""
        names = set(self.names_bound_to(loader))
        for node in self.script.nodes:
            if not (isinstance(node, ast.For) and iterated_name(node.iter) in names):
                continue
            calls = [n for s in node.body for n in walk(s)]
            if not capped and any(isinstance(n, ast.Break) for n in calls):
                return False  # a step cap
            if any(is_backward(n) for n in calls):
                return True
        return False

    @memoized
    def value_reads_rank(self, value: ast.expr) -> bool:
        return self.reads_rank_outside(value, set())

    @memoized
    def value_indexes_by_rank(self, value: ast.expr) -> bool:
        """The value reads the rank other than to test it against a constant."""
        return self.reads_rank_outside(value, constant_tests(value))

    def reads_rank_outside(self, value: ast.expr, skipped: set[int]) -> bool:
        return any(
            isinstance(n, ast.expr)
            and id(n) not in skipped
            and (is_rank_expr(n, self.script) or read_name(n) in self.rank_holders)
            for n in outside_placements(self.script, value)
        )

    @cached_property
    def rank_holders(self) -> set[str]:
        """Names that hold the rank under another name: `me = dist.get_rank()`, `r = me`.

        Only a rank passed on whole (maybe through int()): `start = rank * n` is no rank,
        and `device = torch.device("cuda", rank)` must not make a dataset on it "sharded".
        """
        copies: dict[str, list[str]] = {}  # name -> the names assigned a copy of it
        found: list[str] = []
        for name, value in self.single_assignments:
            value = without_int(value)
            if is_rank_expr(value, self.script):
                found.append(name)
            elif read_name(value) is not None:
                copies.setdefault(read_name(value), []).append(name)
        holders: set[str] = set()
        while found:  # each name is passed on once, so chains of copies stay linear
            name = found.pop()
            if name not in holders:
                holders.add(name)
                found.extend(copies.get(name, ()))
        return holders

    @cached_property
    def single_assignments(self) -> list[tuple[str, ast.expr]]:
        """(name, value) of every assignment, a tuple's elements paired: `a, b = x, y`."""
        return [
            (name, value)
            for name, values in self.assignments.items()
            for value in values
            if not is_sequence(value)
        ]

    def prepared(self, loader: ast.Call) -> bool:
        """Handed to `accelerator.prepare(...)` / `fabric.setup_dataloaders(...)`."""
        ids, names = self.handed_to_preparers
        return id(loader) in ids or bool(names & set(self.names_bound_to(loader)))

    def iterated_where_built(self, loader: ast.Call) -> bool:
        """The function that builds the loader loops over it (`for batch in loader`),
        rather than returning it to a caller that may prepare it."""
        scope = enclosing_scope(loader, self.script)
        if scope is None:
            return False
        names = set(self.names_bound_to(loader))
        return any(
            isinstance(node, ast.For)
            and (node.iter is loader or (isinstance(node.iter, ast.Name) and node.iter.id in names))
            for node in self.script.scope_nodes(scope)
        )

    def names_bound_to(self, call: ast.Call) -> list[str]:
        """The names a call's value is assigned to (`x = call`, `self.x = call`, and
        `x = call if args.distributed else None`)."""
        value: ast.AST = call
        parent = self.parents.get(id(call))
        while isinstance(parent, ast.IfExp) and parent.test is not value:
            value, parent = parent, self.parents.get(id(parent))
        if isinstance(parent, ast.Assign) and parent.value is value:
            return [n for target in parent.targets for n in bound_names(kept_in(target))]
        if isinstance(parent, (ast.AnnAssign, ast.NamedExpr)) and parent.value is value:
            return bound_names(kept_in(parent.target))
        return []

    # -------------------------------------------------------------- who runs a loader

    def rank_zero_only(self, loader: ast.Call) -> bool:
        """Built only on rank 0, or every use of it is on rank 0 only (an evaluation loader)."""
        if self.only_some_ranks(loader):
            return True
        verdicts = [self.read_on_rank_zero(name) for name in self.names_bound_to(loader)]
        known = [v for v in verdicts if v is not None]
        return bool(known) and all(known)

    @memoized
    def read_on_rank_zero(self, name: str) -> bool | None:
        """Whether every statement that reads `name` runs on rank 0 only; None if none tells."""
        # Reads in one statement share its verdict: each statement is judged once.
        statements = {
            id(statement): statement
            for statement in map(self.enclosing_statement_with_calls, self.reads.get(name, []))
            if statement is not None
        }
        verdicts = [self.statement_on_rank_zero(s) for s in statements.values()]
        known = [v for v in verdicts if v is not None]
        return all(known) if known else None

    def only_some_ranks(self, call: ast.Call) -> bool:
        """Every traced path to this call is behind a rank-0 (or single-process) branch."""
        paths = self.rank_paths.get(id(call), [])
        return bool(paths) and all(
            any(branch.side in (RANK_ZERO, NO_RANKS) for branch in path) for path in paths
        )

    @memoized
    def statement_on_rank_zero(self, statement: ast.stmt) -> bool | None:
        """Whether a statement using a loader runs on rank 0 only; None if no call tells."""
        traced = [c for c in self.calls_of(statement) if id(c) in self.rank_paths]
        if not traced:
            return None
        return all(self.only_some_ranks(c) for c in traced)

    @memoized
    def calls_of(self, statement: ast.stmt) -> list[ast.Call]:
        return [n for n in walk(statement) if isinstance(n, ast.Call)]

    def enclosing_statement_with_calls(self, node: ast.AST) -> ast.stmt | None:
        current: ast.AST | None = node
        while current is not None:
            if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return None
            if isinstance(current, ast.stmt) and self.calls_of(current):
                return current
            current = self.parents.get(id(current))
        return None

    # -------------------------------------------------------------- samplers and epochs

    def loaders_of(self, sampler: ast.Call) -> set[str]:
        """Names of the loaders a DistributedSampler feeds (by the names they are bound
        to), itself or through a batch sampler built over it (`BatchSampler(sampler, b)`)."""
        keys: list[int | str] = [id(sampler), *self.names_bound_to(sampler)]
        for node, name in self.script.call_names:
            over = node.args[0] if short(name).endswith("BatchSampler") and node.args else None
            if over is not None and (over is sampler or read_name(over) in keys):
                keys += [id(node), *self.names_bound_to(node)]
        return {name for key in keys for name in self.loaders_by_sampler.get(key, ())}

    def pass_loop_of_a_helper(self, loaders: set[str]) -> ast.For | ast.While | None:
        """The loop of a file function, handed one of `loaders`, that walks its
        parameter pass after pass (`def cycle(loader): while True: for b in loader:`)."""
        for node in self.script.nodes:
            if not (isinstance(node, ast.Call) and any(read_name(a) in loaders for a in node.args)):
                continue
            function = self.script.functions.get(read_name(node.func) or "")
            if function is None:
                continue
            parameters = {
                parameter
                for parameter, argument in bound_arguments(function, node)
                if parameter and read_name(argument) in loaders
            }
            loop = self.epoch_loop_over(parameters, near=function)
            if loop is not None and self.home(loop) is function:
                return loop
        return None

    @cached_property
    def loaders_by_sampler(self) -> dict[int | str, set[str]]:
        """A loader's sampler (the call's id, or the name it is read from) -> the loader's names."""
        found: dict[int | str, set[str]] = {}
        for loader in self.loader_calls:
            given = keyword(loader, "sampler") or keyword(loader, "batch_sampler")
            if given is None and len(loader.args) > SAMPLER_POSITION:
                given = loader.args[SAMPLER_POSITION]
            if given is None:
                continue
            names = {*self.names_bound_to(loader), *self.names_of_returned(loader)}
            found.setdefault(id(given), set()).update(names)
            if read_name(given) is not None:
                found.setdefault(read_name(given), set()).update(names)
        return found

    def names_of_returned(self, call: ast.Call) -> set[str]:
        """`return DataLoader(...)` or `return loader, sampler` in f: the names f() is bound to."""
        function = self.enclosing_function(call)
        if function is None:
            return set()
        ids, names = self.returned_by(function)
        if id(call) not in ids and not names & set(self.names_bound_to(call)):
            return set()
        return self.names_of_calls_to(function)

    @memoized
    def names_of_calls_to(self, function: ast.AST) -> set[str]:
        """The names that the calls of a same-file function are bound to (`loader = build()`)."""
        return {
            name
            for caller in self.callers.get(id(function), [])
            for name in self.names_bound_to(caller)
        }

    @memoized
    def returned_by(self, function: ast.AST) -> tuple[set[int], set[str]]:
        """What a function's `return` statements hand back: node ids, and names read."""
        values = [
            node.value
            for node in walk(function)
            if isinstance(node, ast.Return) and node.value is not None
        ]
        inner = [n for value in values for n in walk(value)]
        return {id(n) for n in inner}, {name for name in map(read_name, inner) if name}

    @cached_property
    def callers(self) -> dict[int, list[ast.Call]]:
        """id of a same-file function -> the calls that run it."""
        found: dict[int, list[ast.Call]] = {}
        for node, _name in self.script.call_names:
            for callee in same_file_callees(self.script, node.func, None):
                found.setdefault(id(self.script.functions[callee]), []).append(node)
        return found

    def home(self, node: ast.AST) -> ast.AST | None:
        """The class a node's method belongs to, else its function; None at module level."""
        function = self.enclosing_function(node)
        if function is None:
            return None
        owner = self.parents.get(id(function))
        return owner if isinstance(owner, ast.ClassDef) else function

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        current = self.parents.get(id(node))
        while current is not None and not isinstance(
            current, (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            current = self.parents.get(id(current))
        return current

    def epoch_loop_over(self, loaders: set[str], near: ast.AST) -> ast.For | ast.While | None:
        """An outer loop whose body walks one of `loaders` (or hands it to a function).

        Loaders are matched by name, and two functions may both call theirs
        `loader`: loops of the sampler's own class or function are tried first.
        """
        home = self.home(near)
        firsts = [self.first_loops[name] for name in loaders if name in self.first_loops]
        at_home = [by_home[home] for _first, by_home in firsts if home in by_home]
        return min(at_home or [first for first, _by_home in firsts], key=line_of, default=None)

    @cached_property
    def first_loops(
        self,
    ) -> dict[str, tuple[ast.For | ast.While, dict[ast.AST | None, ast.For | ast.While]]]:
        """Name -> the first loop that walks it, and the first in each class or function."""
        homes = self.loop_homes
        found = {}
        for name, loops in self.loops_walking.items():
            by_home: dict[ast.AST | None, ast.For | ast.While] = {}
            for loop in sorted(loops, key=line_of):
                by_home.setdefault(homes[id(loop)], loop)
            found[name] = (min(loops, key=line_of), by_home)
        return found

    @cached_property
    def loop_homes(self) -> dict[int, ast.AST | None]:
        """id of a loop that walks a name -> its class or function (looked up once each)."""
        return {
            id(loop): self.home(loop) for loops in self.loops_walking.values() for loop in loops
        }

    @cached_property
    def loops_walking(self) -> dict[str, list[ast.For | ast.While]]:
        """Name -> the loops whose body walks it, themselves or in a function they call.

        Not a loop over the name itself: `for x in loader: ... len(loader)` is one pass.
        One walk of the file: a node counts for the innermost loop whose body holds it,
        and a loop's names for the loops around it, so nested loops are not walked again
        for each loop around them.
        """
        walked: dict[int, set[str]] = {}
        callees: dict[int, set[str]] = {}
        outer: dict[int, ast.For | ast.While | None] = {}
        loops: list[ast.For | ast.While] = []  # each found after the loops around it
        stack: list[tuple[ast.AST, ast.For | ast.While | None]] = [(self.script.tree, None)]
        while stack:
            node, owner = stack.pop()
            if owner is not None:
                names, called = self.walks_of(node)
                walked[id(owner)] |= names
                callees[id(owner)] |= called
            if not isinstance(node, (ast.For, ast.While)):
                stack.extend((child, owner) for child in children(node))
                continue
            loops.append(node)
            outer[id(node)], walked[id(node)], callees[id(node)] = owner, set(), set()
            body = {id(stmt) for stmt in node.body}
            stack.extend((child, node if id(child) in body else owner) for child in children(node))
        for loop in reversed(loops):
            around = outer[id(loop)]
            if around is not None:
                walked[id(around)] |= walked[id(loop)]
                callees[id(around)] |= callees[id(loop)]
        found: dict[str, list[ast.For | ast.While]] = {}
        for loop in (n for n in self.script.nodes if isinstance(n, (ast.For, ast.While))):
            names = set(walked[id(loop)])
            for callee in callees[id(loop)]:
                names |= self.function_walks[callee]
            if isinstance(loop, ast.For):
                names -= {n for n in map(read_name, walk(loop.iter)) if n}
            for name in names:
                found.setdefault(name, []).append(loop)
        return found

    # -------------------------------------------------------------- a sampler built each epoch

    def reseeded_each_pass(self, sampler: ast.Call, loaders: set[str]) -> bool:
        """Built anew in the epoch loop with a seed of its variable (`for epoch in ...:` then
        `DistributedSampler(ds, seed=base_seed + epoch)`): each epoch has its own order.

        Not when the seed is an outer loop's only (`for run in ...: for epoch in ...:`
        around `sampler = ...(seed=run)`: every epoch of a run repeats it), nor when a loop
        of its class or function walks the loader without building it anew.
        """
        around = self.loops_around(sampler)
        epochs = [loop for loop in around if self.walks_any(loop, loaders)]
        if not epochs or self.walked_elsewhere(sampler, epochs, loaders):
            return False
        seed = seed_of(sampler)
        if seed is None:
            return False
        # The innermost loop that walks the loader runs the epochs; its variable must change it.
        return bool(self.names_read_in(epochs[0].target) & self.names_behind(seed))

    def walks_any(self, loop: ast.AST, loaders: set[str]) -> bool:
        return any(id(loop) in self.walking_ids.get(name, ()) for name in loaders)

    @cached_property
    def walking_ids(self) -> dict[str, set[int]]:
        """Name -> ids of the loops that walk it (loops_walking, as sets)."""
        return {name: {id(loop) for loop in loops} for name, loops in self.loops_walking.items()}

    def walked_elsewhere(self, sampler: ast.Call, epochs: list[ast.AST], loaders: set[str]) -> bool:
        """A loop of the sampler's class or function walks a loader and is not one of `epochs`.

        Counted, not compared loop by loop: a hostile file may have thousands of such loops.
        """
        at_home = self.walking_at_home.get(self.home(sampler), {})
        return any(
            len(at_home.get(name, ())) > sum(id(loop) in at_home.get(name, ()) for loop in epochs)
            for name in loaders
        )

    @cached_property
    def walking_at_home(self) -> dict[ast.AST | None, dict[str, set[int]]]:
        """Class or function -> name -> ids of its loops that walk the name."""
        found: dict[ast.AST | None, dict[str, set[int]]] = {}
        for name, loops in self.loops_walking.items():
            for loop in loops:
                by_name = found.setdefault(self.loop_homes[id(loop)], {})
                by_name.setdefault(name, set()).add(id(loop))
        return found

    def loops_around(self, node: ast.AST) -> list[ast.For | ast.AsyncFor]:
        """The `for` loops whose body holds `node`, innermost first."""
        found = []
        child, current = node, self.parents.get(id(node))
        while current is not None:
            if isinstance(current, (ast.For, ast.AsyncFor)) and in_body(child, current):
                found.append(current)
            child, current = current, self.parents.get(id(current))
        return found

    def names_behind(self, expr: ast.expr) -> set[str]:
        """Names `expr` is worked out from: its own, its origin's, and the seeds of the
        generators it draws from (`g.manual_seed(epoch)`; `seed=int(torch.randint(...,
        generator=g))`)."""
        values = self.origin(expr)
        seeds = (
            seed
            for value in values
            for name in self.names_read_in(value)
            for seed in self.seeds_given.get(name, ())
        )
        # The first few only, like origin itself: a hostile file may seed a name thousands of times.
        seeded = list(islice((v for seed in seeds for v in self.origin(seed)), MAX_ORIGINS))
        return {name for value in [*values, *seeded] for name in self.names_read_in(value)}

    @memoized
    def names_read_in(self, value: ast.expr) -> frozenset[str]:
        return frozenset(name for name in map(read_name, walk(value)) if name)

    @cached_property
    def seeds_given(self) -> dict[str, list[ast.expr]]:
        """Name -> the seeds its `.manual_seed(...)` / `.seed(...)` statements give it."""
        found: dict[str, list[ast.expr]] = {}
        for node, _name in self.script.call_names:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in SEEDING_METHODS:
                name = read_name(func.value)
                if name is not None:
                    found.setdefault(name, []).extend(node.args)
        return found

    @cached_property
    def function_walks(self) -> dict[str, set[str]]:
        """Same-file function -> the names its body walks (`for batch in self.loader:`)."""
        found: dict[str, set[str]] = {}
        for name, function in self.script.functions.items():
            found[name] = set()
            for node in (n for stmt in function.body for n in walk(stmt)):
                found[name] |= self.walks_of(node)[0]
        return found

    def walks_of(self, node: ast.AST) -> tuple[set[str], set[str]]:
        """Names a `for` iterates or a call is handed; the same-file functions a call runs."""
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return {n for n in map(read_name, walk(node.iter)) if n}, set()
        if isinstance(node, ast.Call):
            passed = [kept_in(a) for a in [*node.args, *(k.value for k in node.keywords)]]
            called = same_file_callees(self.script, node.func, None)
            return {n for n in map(read_name, passed) if n}, set(called)
        return set(), set()


def kept_in(target: ast.expr) -> ast.expr:
    """`loaders[task]` -> `loaders`: a value stored in (or read from) a container by key
    is the container's (`loaders[t] = DataLoader(...)`, then `iter(loaders[t])`)."""
    while isinstance(target, ast.Subscript):
        target = target.value
    return target


def in_body(child: ast.AST, loop: ast.For | ast.AsyncFor) -> bool:
    """A child of the loop in its body, not its target, iterable or else branch.

    By position, not by looking through the body: a hostile loop may hold thousands.
    """
    if not isinstance(child, ast.stmt):
        return False
    return not loop.orelse or child.lineno < loop.orelse[0].lineno


def is_sequence(value: ast.expr) -> bool:
    return isinstance(value, (ast.Tuple, ast.List))


def paired(target: ast.expr, value: ast.expr) -> Iterator[tuple[str, ast.expr]]:
    """`a, (b, c) = x, (y, z)` -> (a, x), (b, y), (c, z); a name unpacked from one value gets
    that value."""
    for element, part in paired_elements(target, value):
        yield from ((name, part) for name in bound_names(element))


def paired_fields(target: ast.expr, value: ast.expr) -> Iterator[tuple[str, ast.expr]]:
    """`paired`, for the `self.` fields the target binds only."""
    for element, part in paired_elements(target, value):
        pending = [element]
        while pending:
            current = pending.pop()
            if isinstance(current, ast.Tuple | ast.List):
                pending.extend(current.elts)
            elif (field := self_attribute(current)) is not None:
                yield field, part


def paired_elements(target: ast.expr, value: ast.expr) -> Iterator[tuple[ast.expr, ast.expr]]:
    """(target element, its value) as unpacking pairs them. Iterative: a tuple nested
    a thousand deep is hostile input, not a script."""
    pending = [(target, value)]
    while pending:
        target, value = pending.pop()
        if is_sequence(target) and is_sequence(value) and len(target.elts) == len(value.elts):
            pending.extend(zip(target.elts, value.elts))
        else:
            yield target, value


def line_of(node: ast.stmt) -> int:
    return node.lineno


def loops_with_backward(function: ast.AST) -> bool:
    """A loop of `function` with a backward in it: over the loader it was handed,
    or over anything (it may hand the loader on), so a trainer, not a scorer."""
    return any(
        isinstance(node, ast.For | ast.While)
        and any(is_backward(n) for statement in node.body for n in walk(statement))
        for node in walk(function)
    )


def iterated_name(items: ast.expr) -> str | None:
    """`loader`, `enumerate(loader)`, `tqdm(loader, ...)` -> "loader"."""
    if isinstance(items, ast.Call) and items.args:
        items = items.args[0]
    return read_name(items)


def bound_names(target: ast.expr) -> list[str]:
    """Names a target binds: `x`, `self.x` (as "x"), each name of a tuple."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in bound_names(element)]
    name = read_name(target)
    return [name] if name is not None else []


def read_name(node: ast.AST) -> str | None:
    """`x` -> "x", `self.x` -> "x"; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    return self_attribute(node)


# Keyword arguments that name a GPU: `DDP(model, device_ids=[gpu])`, `device=rank`.
PLACING_KEYWORDS = frozenset({"device_ids", "output_device", "device", "device_id"})


def outside_placements(script: Script, value: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `value`, each once, leaving out the arguments of calls that only
    place or seed (rank_dependent.is_placement: `x.to(device)`, `torch.device("cuda",
    rank)`, a seed) and keywords that name a GPU (`device_ids=[gpu]`): the rank
    they read picks a GPU, it does not cut the data."""
    pending = [value]
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, ast.Call) and is_placement(script, node):
            if isinstance(node.func, ast.Attribute):
                pending.append(node.func.value)  # what `.to()` moves is still read
            continue
        if isinstance(node, ast.keyword) and node.arg in PLACING_KEYWORDS:
            continue
        pending.extend(children(node))


def called_name_of(expr: ast.expr) -> str:
    """`Sampler` for `Sampler`, `data.Sampler` or `Sampler[int]`."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


def words_in(node: ast.AST) -> Iterator[str]:
    """Every identifier, attribute and string constant under `node`."""
    for part in walk(node):
        if isinstance(part, ast.Name):
            yield part.id
        elif isinstance(part, ast.Attribute):
            yield part.attr
        elif isinstance(part, ast.arg):
            yield part.arg
        elif isinstance(part, ast.Constant) and isinstance(part.value, str):
            yield part.value


def identifiers(node: ast.AST) -> set[str]:
    """The names and attribute names `node` holds (`ds.shard(n, rank)` -> ds, shard, n, rank)."""
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in walk(node)
        if isinstance(n, (ast.Name, ast.Attribute))
    }


def constant_tests(value: ast.expr) -> set[int]:
    """ids of the nodes compared with constants in `value` (`rank == 0`, `rank in (-1, 0)`):
    a test of which rank this is, not an index that picks data."""
    tested: set[int] = set()
    for node in walk(value):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        constant = [is_constant(side) for side in sides]
        if any(constant):
            for side, is_const in zip(sides, constant, strict=True):
                if not is_const:
                    tested.update(id(n) for n in walk(side))
    return tested


def is_constant(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.UnaryOp):
        return is_constant(expr.operand)
    return isinstance(expr, ast.Tuple | ast.List | ast.Set) and all(map(is_constant, expr.elts))


def only_compared(function: ast.AST, name: str, also: frozenset[int] = frozenset()) -> bool:
    """Every read of `name` in `function` is a side of a comparison with a constant
    (or one of the nodes `also` allows)."""
    tested = constant_tests(function) | also
    return all(
        id(n) in tested
        for n in walk(function)
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
    )


def ranks_given_to_samplers(script: Script, function: ast.AST) -> frozenset[int]:
    """ids of the names a sampler is given as its rank (`DistributedSampler(ds,
    rank=rank)`): the sampler takes this rank's share, the dataset stays whole."""
    return frozenset(
        id(k.value)
        for node in walk(function)
        if isinstance(node, ast.Call) and short(script.name_of(node.func)).endswith("Sampler")
        for k in node.keywords
        if k.arg == "rank" and isinstance(k.value, ast.Name)
    )
