"""A batch sampler that shards the samples by rank, then batches each rank's
share on its own by length or by bucket (uneven-inputs).

Speech, translation and diffusion trainers batch by length (as many
utterances as fit a frame or token budget) or by bucket (images of one
aspect ratio together). Done after `indices[rank::world]`, each rank packs
its own share: one rank's long utterances make fewer batches, another's
bucket leaves a partial one. The ranks then run different numbers of steps;
the first to finish leaves the epoch (for the evaluation's barrier, the next
epoch's first collective) while the others wait in DDP's gradient all-reduce
until the timeout.

Read only where the file shows it all: a class with `__iter__` that strides
its samples by rank (`[rank::world]`, `range(rank, n, world)`), or is handed
a rank's share made so, and groups them by data (a dict of lists, or an `if`
against a `max_*` budget), with no collective in it to agree on a count,
passed as a DataLoader's batch_sampler (or as the dataset of a loader with
batch_size=None, which yields whole batches) in a DDP script without `join`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from assistant.lint.checks.data import (
    DataFlow,
    check_rank_file_shards_of_uneven_length,
    equalizes_steps,
)
from assistant.lint.model import Script, full_text, keyword, position, short, source_text, walk
from assistant.lint.registry import check
from assistant.lint.torchapi import is_backward, is_collective, is_ddp, is_distributed
from assistant.results import Finding

RANK_WORD = re.compile(r"rank", re.IGNORECASE)
WORLD_WORD = re.compile(r"world|replicas|nranks|num_gpus|n_gpus|ngpus", re.IGNORECASE)
# A budget a length-based batch is packed against: max_frames, max_tokens, self.limit.
BUDGET_WORD = re.compile(r"max|limit|budget|capacity", re.IGNORECASE)
GROUPING_FACTORIES = frozenset({"defaultdict"})
# Assignments followed from the grouping's result (`self._batches`) to what is strided
# (`batches = list(self._batches)`).
BATCH_HOLDER_HOPS = 3
BATCH_ADDS = frozenset({"append", "extend"})


@check("uneven-inputs")
def check_batches_formed_per_rank_after_sharding(script: Script) -> Iterator[Finding]:
    """`shard = order[self.rank::self.world]` and then batches packed by
    `max_frames` or grouped by bucket, in a DataLoader's batch_sampler or in
    the iterable dataset that yields the batches itself (batch_size=None)."""
    if not is_distributed(script) or equalizes_steps(script):
        return
    made = batching_classes(script)
    for cls in (n for n in script.of_type(ast.ClassDef) if n.name in made):
        if not any(isinstance(s, ast.FunctionDef) and s.name == "__iter__" for s in cls.body):
            continue
        cut = data_grouping(cls)
        if cut is None or agrees_on_a_count(script, cls):
            continue
        where, grouping = cut
        stride = rank_stride(cls)
        if stride is None:
            stride = next(filter(None, (strided_argument(script, c) for c in made[cls.name])), None)
        elif position(where) < position(stride) or strides_the_batches(cls, stride, where):
            # batches cut over all samples, then dealt out: equal counts only when
            # the count is trimmed or padded to a multiple of the world size
            if not evens_the_count(cls):
                yield dealt_out_untrimmed(script, cls, stride)
            continue
        if stride is None:
            continue
        yield script.finding(
            "uneven-inputs",
            stride,
            f"{cls.name} gets each rank's share of the data here, then batches that "
            f"share by itself ({grouping}): ranks get different numbers of batches, and the "
            "first to finish its epoch moves on while the others wait in DDP's gradient "
            "all-reduce (a hang until the timeout); form the batches over all samples and "
            "give each rank the same count (batches[rank::world], trimmed to a multiple of "
            "the world size), or agree on the smallest count with "
            "all_reduce(op=ReduceOp.MIN), or train inside `with model.join():`",
        )


@check("uneven-inputs")
def check_groups_dealt_by_rank_then_expanded(script: Script) -> Iterator[Finding]:
    """A dataset or sampler of the file that takes this rank's stride of groups
    (`self.files[self.rank::self.world]`, whole videos) and yields what each group
    holds (`for path in files: for t in range(len(f[run]) - span): yield ...`,
    `for v in order: yield from self.mine[v]`), trained on to the loader's end: the
    groups hold different numbers of items, so each rank's epoch has its own
    number of steps even when the groups share out evenly."""
    if not is_distributed(script) or not any(is_ddp(name) for _, name in script.call_names):
        return
    if equalizes_steps(script):
        return
    loaded = loaded_classes(script)
    reported: set[int] | None = None  # the loaders data.py's shard check already names
    flow: DataFlow | None = None  # built only for a class that deals groups out
    for cls in (n for n in script.of_type(ast.ClassDef) if n.name in loaded):
        iterate = next(
            (s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__iter__"), None
        )
        stride = rank_stride(cls)
        if iterate is None or stride is None or agrees_on_a_count(script, cls):
            continue
        expanding = group_expansion(cls, iterate)
        if expanding is None:
            continue
        flow = flow or DataFlow(script)
        # trained on to the loader's end: a loop with a backward and no `break` (a cap
        # on the steps leaves every rank after the same count)
        if not any(flow.trains_on(loader) for loader in loaded[cls.name]):
            continue
        if reported is None:
            reported = {f.line for f in check_rank_file_shards_of_uneven_length(script)}
        if any(loader.lineno in reported for loader in loaded[cls.name]):
            continue  # "DataLoader over Stream(keys, rank, world) reads this rank's own share"
        yield script.finding(
            "uneven-inputs",
            stride,
            f"{cls.name} deals whole groups out by rank here and yields what each group "
            f"holds (line {expanding.lineno}): groups hold different numbers of items, so "
            "each rank's epoch has its own number of batches, and the ranks still training "
            "wait in DDP's gradient all-reduce for the ones that ran out (a hang at the end "
            "of the epoch); give every rank the same number of steps (stop each epoch "
            "after a count agreed with all_reduce(op=ReduceOp.MIN), or cycle the stream "
            "and train a fixed number of steps), or train inside `with model.join():`",
        )


def loaded_classes(script: Script) -> dict[str, list[ast.Call]]:
    """Classes of the file a DataLoader reads from (its dataset, sampler or
    batch_sampler), with the loader calls, found directly or through a name."""
    found: dict[str, list[ast.Call]] = {}
    for node, name in script.call_names:
        if short(name) != "DataLoader":
            continue
        given = [*node.args[:1], *(k.value for k in node.keywords if k.arg in LOADER_SOURCES)]
        for argument in given:
            for made in constructions(script, argument):
                found.setdefault(made.func.id, []).append(node)
    return found


def constructions(script: Script, argument: ast.expr) -> list[ast.Call]:
    """The calls of a plain name (a class of the file, most often) that an argument
    is, or that the name it passes is assigned: `Sampler(...)`, `sampler`."""
    values = [argument]
    if isinstance(argument, ast.Name):
        values += script.assigned_values.get(argument.id, [])
    return [v for v in values if isinstance(v, ast.Call) and isinstance(v.func, ast.Name)]


LOADER_SOURCES = frozenset({"dataset", "sampler", "batch_sampler"})


def group_expansion(cls: ast.ClassDef, iterate: ast.FunctionDef) -> ast.AST | None:
    """Where the class's iteration yields a group's own items: a `yield from` inside
    a loop, or a `yield` inside a loop nested in another whose count the data sets
    (not `range` of a constant or a field: as many repeats of each item everywhere),
    or a `while True` that reads a group until it ends (`if k == 0: break`). Read in
    __iter__ and the methods of the class it calls; None when the iteration never
    ends by itself (a `while True` with no break: an endless stream the loop cuts)."""
    methods = {s.name: s for s in cls.body if isinstance(s, ast.FunctionDef)}
    bodies = [iterate] + [
        methods[n.func.attr]
        for n in walk(iterate)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
        and n.func.attr in methods
    ]
    endless = [
        n for body in bodies for n in walk(body) if isinstance(n, ast.While) and is_true(n.test)
    ]
    if any(not leaves_itself(loop) for loop in endless):
        return None
    for body in bodies:
        for outer in (n for n in walk(body) if isinstance(n, ast.For)):
            for node in walk(outer):
                if isinstance(node, ast.YieldFrom) and node is not outer:
                    return node
                inner_count = (
                    isinstance(node, ast.For) and not counts_a_fixed_number(node.iter)
                ) or (
                    isinstance(node, ast.While) and node in endless  # read until the file ends
                )
                if (
                    inner_count
                    and node is not outer
                    and any(isinstance(y, ast.Yield) for y in walk(node))
                ):
                    return node
    return None


def leaves_itself(loop: ast.While) -> bool:
    """A `break` of the loop's own (not of a loop inside it): `while True: block =
    f.read(n); if not block: break`, a read that ends with its file."""
    pending: list[ast.AST] = list(loop.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Break):
            return True
        if isinstance(node, ast.For | ast.While | ast.AsyncFor | ast.FunctionDef):
            continue
        pending.extend(ast.iter_child_nodes(node))
    return False


def is_true(test: ast.expr) -> bool:
    return isinstance(test, ast.Constant) and bool(test.value)


def counts_a_fixed_number(iterated: ast.expr) -> bool:
    """`range(4)`, `range(self.repeats)`: the same count for every group."""
    return (
        isinstance(iterated, ast.Call)
        and isinstance(iterated.func, ast.Name)
        and iterated.func.id == "range"
        and all(isinstance(a, ast.Constant | ast.Attribute | ast.Name) for a in iterated.args)
    )


# Wrappers a loop puts around what it iterates: the items are the same.
ITERATION_WRAPPERS = frozenset({"enumerate", "tqdm", "iter", "list"})


@check("uneven-inputs")
def check_training_loop_over_a_rank_stride(script: Script) -> Iterator[Finding]:
    """`for idx in batches[rank::world]: ... loss.backward()` in a DDP script: the
    loop runs ceil((n - rank) / world) steps, one more on the first ranks whenever n
    is no multiple of the world size, and that extra step's gradient all-reduce
    waits for ranks that already left the loop."""
    if not is_distributed(script) or not any(is_ddp(name) for _, name in script.call_names):
        return
    if equalizes_steps(script):
        return
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        if evens_the_count(scope):
            continue  # `n = len(batches) // world * world`: trimmed to share out
        for loop in (n for n in nodes if isinstance(n, ast.For)):
            stride = iterated_stride(script, loop.iter)
            if stride is None or not any(is_backward(n) for n in walk(loop)):
                continue
            yield script.finding(
                "uneven-inputs",
                loop.iter,
                f"the training loop steps through a rank's share ({source_text(stride)}) of "
                "a list whose length no line trims to a multiple of the world size: the "
                "first ranks get one item more whenever it is not one, and their extra "
                "step waits in DDP's gradient all-reduce for ranks that already left the "
                "loop (a hang until the timeout); drop the last len(items) % world items "
                "(or repeat the first ones) before dealing them out, or train inside "
                "`with model.join():`",
            )


def iterated_stride(script: Script, iterated: ast.expr) -> ast.AST | None:
    """The rank stride a loop iterates: `items[rank::world]` in place, through
    enumerate() / tqdm(), or a name bound to one."""
    while (
        isinstance(iterated, ast.Call)
        and isinstance(iterated.func, ast.Name | ast.Attribute)
        and short(called(iterated)) in ITERATION_WRAPPERS
        and iterated.args
    ):
        iterated = iterated.args[0]
    candidates: list[ast.AST] = [iterated]
    if isinstance(iterated, ast.Name):
        candidates += script.assigned_values.get(iterated.id, [])
    # `order = my_ids[:]` (shuffled in place after): a copy of a name bound to a stride
    candidates += [
        value
        for copy in candidates
        if isinstance(copy, ast.Subscript)
        and isinstance(copy.value, ast.Name)
        and isinstance(copy.slice, ast.Slice)
        and copy.slice.lower is copy.slice.upper is copy.slice.step is None
        for value in script.assigned_values.get(copy.value.id, [])
    ]
    for candidate in candidates:
        if isinstance(candidate, ast.Subscript) and (stride := rank_stride(candidate.slice)):
            return stride
    return None


def evens_the_count(cls: ast.AST) -> bool:
    """Arithmetic with the world size on a count (`n - n % world`, `n // world *
    world`, `ceil(n / replicas)`, n a length): the batches are trimmed or padded to
    share out. A learning rate scaled by the world size (`lr * math.sqrt(world)`)
    evens nothing."""

    def names_made(accepts: Callable[[ast.expr], bool]) -> set[str]:
        return {
            target.id
            for node in walk(cls)
            if isinstance(node, ast.Assign) and accepts(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }

    lengths = names_made(reads_a_length)
    # `chunk = world_size * cfg.update_freq`: a multiple of the world size
    multiples = names_made(
        lambda value: (
            isinstance(value, ast.BinOp)
            and isinstance(value.op, ast.Mult)
            and bool(WORLD_WORD.search(full_text(value)))
        )
    )

    def names_the_world(side: ast.expr) -> bool:
        return bool(WORLD_WORD.search(full_text(side))) or any(
            isinstance(n, ast.Name) and n.id in multiples for n in walk(side)
        )

    return any(
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mod | ast.FloorDiv | ast.Div | ast.Mult)
        and any(names_the_world(side) for side in (node.left, node.right))
        and any(
            reads_a_length(side) or (isinstance(n, ast.Name) and n.id in lengths)
            for side in (node.left, node.right)
            for n in walk(side)
        )
        for node in walk(cls)
    )


def reads_a_length(expr: ast.AST) -> bool:
    """`len(items)`, `x.size(0)`, `x.shape[0]`, `x.numel()`."""
    return any(
        (isinstance(n, ast.Call) and short(called(n)) in ("len", "size", "numel"))
        or (isinstance(n, ast.Attribute) and n.attr == "shape")
        for n in walk(expr)
    )


def strides_the_batches(cls: ast.ClassDef, stride: ast.AST, where: ast.AST) -> bool:
    """The rank's stride walks what the grouping made, wherever the class writes it:
    `self._batches = self._bucketize()` in __init__, then `range(rank,
    len(self._batches), world)` (the method that cuts batches may sit below)."""
    grouping = next(
        (m for m in cls.body if isinstance(m, ast.FunctionDef) and where in walk(m)), None
    )
    if grouping is None:
        return False
    assigns = [n for n in walk(cls) if isinstance(n, ast.Assign)]
    holders = {
        source_text(target)
        for node in assigns
        if isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == grouping.name
        for target in node.targets
    }
    for _ in range(BATCH_HOLDER_HOPS):
        holders |= {
            source_text(target)
            for node in assigns
            if read_texts(node.value) & holders
            for target in node.targets
        }
    walked = stride.args[1] if isinstance(stride, ast.Call) else sliced_container(cls, stride)
    return walked is not None and bool(read_texts(walked) & holders)


def read_texts(expr: ast.AST) -> set[str]:
    """The names and fields an expression reads (`batches`, `self._batches`)."""
    return {source_text(n) for n in walk(expr) if isinstance(n, ast.Name | ast.Attribute)}


def sliced_container(cls: ast.ClassDef, stride: ast.AST) -> ast.expr | None:
    """What a stride slice cuts: `batches` of `batches[rank::world]`."""
    return next(
        (n.value for n in walk(cls) if isinstance(n, ast.Subscript) and n.slice is stride), None
    )


def dealt_out_untrimmed(script: Script, cls: ast.ClassDef, stride: ast.AST) -> Finding:
    return script.finding(
        "uneven-inputs",
        stride,
        f"{cls.name} cuts its batches over all samples, then deals them out by rank "
        "without trimming the count to a multiple of the world size: when it is not one, "
        "some ranks get one batch more, and their extra step waits in DDP's gradient "
        "all-reduce for ranks that already left the epoch (a hang until the timeout); "
        "drop the last len(batches) % world batches (or repeat the first ones) before "
        "`batches[rank::world]`",
    )


def batching_classes(script: Script) -> dict[str, list[ast.Call]]:
    """The classes that cut a DataLoader's batches, with the calls that make them:
    its batch_sampler (`batch_sampler=LengthSampler(...)`, or through a name), or
    the dataset of a loader that batches nothing itself (batch_size=None)."""
    made: dict[str, list[ast.Call]] = {}
    for node, name in script.call_names:
        if short(name) != "DataLoader":
            continue
        given = keyword(node, "batch_sampler")
        size = keyword(node, "batch_size")
        if given is None and isinstance(size, ast.Constant) and size.value is None:
            given = keyword(node, "dataset") or (node.args[0] if node.args else None)
        if given is None:
            continue
        for value in constructions(script, given):
            made.setdefault(value.func.id, []).append(value)
    return made


def strided_argument(script: Script, made: ast.Call) -> ast.AST | None:
    """A rank's share handed to the class: `Batcher(shards[rank::world])`, or a
    name assigned one (`my_shards = all_shards[rank::world]`)."""
    for argument in [*made.args, *(k.value for k in made.keywords)]:
        candidates: list[ast.AST] = [argument]
        if isinstance(argument, ast.Name):
            candidates += script.assigned_values.get(argument.id, [])
        for candidate in candidates:
            if stride := rank_stride(candidate):
                return stride
    return None


def rank_stride(tree: ast.AST) -> ast.AST | None:
    """`items[self.rank::self.world]` or `range(rank, n, world)` in the tree."""
    for node in walk(tree):
        if (
            isinstance(node, ast.Slice)
            and node.lower is not None
            and node.step is not None
            and names_rank_and_world(node.lower, node.step)
        ):
            return node
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "range"
            and len(node.args) == 3
            and names_rank_and_world(node.args[0], node.args[2])
        ):
            return node
    return None


def names_rank_and_world(start: ast.expr, step: ast.expr) -> bool:
    return bool(RANK_WORD.search(full_text(start)) and WORLD_WORD.search(full_text(step)))


def data_grouping(cls: ast.ClassDef) -> tuple[ast.AST, str] | None:
    """Where and how the class cuts batches by data: a loop over a dict of lists
    ("grouped by bucket"), or an `if` against a max_* budget that closes a batch
    ("packed up to ..."); None if neither."""
    buckets = bucket_dicts(cls)
    for node in walk(cls):
        if (
            isinstance(node, ast.For)
            and isinstance(node.iter, ast.Call)
            and isinstance(node.iter.func, ast.Attribute)
            and node.iter.func.attr in ("values", "items")
            and source_text(node.iter.func.value) in buckets
        ):
            return node, "grouped by bucket"
        if isinstance(node, ast.If) and (budget := budget_name(node.test)) and closes_a_batch(node):
            return node, f"packed up to {budget}"
    return None


def bucket_dicts(cls: ast.ClassDef) -> set[str]:
    """Names and fields the class fills as a dict of lists: `defaultdict(list)`,
    `d.setdefault(key, []).append(i)`."""
    found = set()
    for node in walk(cls):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and short(called(node.value)) in GROUPING_FACTORIES
        ):
            found |= {source_text(target) for target in node.targets}
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "setdefault"
        ):
            found.add(source_text(node.func.value))
    return found


def called(node: ast.Call) -> str:
    return source_text(node.func)


def budget_name(test: ast.expr) -> str | None:
    """`self.max_frames` in `if total + n > self.max_frames:`: a name or field
    of a compared side (not the max() function)."""
    for node in walk(test):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            for part in walk(side):
                if isinstance(part, ast.Name | ast.Attribute) and names_a_budget(part):
                    return source_text(part)
    return None


def names_a_budget(part: ast.Name | ast.Attribute) -> bool:
    word = part.attr if isinstance(part, ast.Attribute) else part.id
    return bool(BUDGET_WORD.search(word)) and word not in ("max", "min")


def closes_a_batch(branch: ast.If) -> bool:
    """The branch yields a batch or appends one to a list of batches."""
    for statement in branch.body:
        for node in walk(statement):
            if isinstance(node, ast.Yield | ast.YieldFrom):
                return True
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in BATCH_ADDS
            ):
                return True
    return False


def agrees_on_a_count(script: Script, cls: ast.ClassDef) -> bool:
    """A collective in the class, or a count padded or trimmed to a multiple of
    the world size (`len(b) % self.world`): the ranks settle on one number."""
    for node in walk(cls):
        if isinstance(node, ast.Call) and is_collective(script.name_of(node.func)):
            return True
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod | ast.FloorDiv)
            and WORLD_WORD.search(full_text(node.right))
        ):
            return True
    return False
