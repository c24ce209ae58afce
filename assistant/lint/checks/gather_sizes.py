"""all_gather of a tensor whose number of rows depends on this rank's data.

`dist.all_gather(bufs, dets)` needs the same shape on every rank: each rank
receives into buffers shaped like its own tensor. Detections kept after a
score threshold or NMS, the rows a boolean mask selects, `nonzero()` or
`unique()`, and a rank's strided share of a list (`items[rank::world]`,
`range(rank, n, world)`, one item more on the first ranks unless the length
divides evenly; also through a loader over it and the batches it yields) give each
rank a different count, so the gather fails ("Sizes of
tensors must match"), hangs, or returns rows cut or padded with garbage,
depending on the backend and version. The fix: gather the sizes first and
pad to the largest (or all_gather_object).

Read within one function: the tensor's value, back through the names and
the lists appended to that made it (what a statement on every path to the
gather assigns anew replaces what came before it), must hold such a
content-sized step;
the receive buffers must be sized from the tensor itself (`zeros_like(t)`);
and the function must not exchange sizes first (a collective on a tensor
built from `len()`, `.shape`, `.size()` or `.numel()`), which is how a
padded gather starts. A tensor made from a parameter is followed to what
the file's callers pass for it, two calls up (a loader over a strided share
built in main(), handed down to the function that gathers). A tensor with
one row per sample (logits, features) is the same size on every rank under
a DistributedSampler, and stays quiet: so is a batch's own field (a
classifier's `batch["labels"]`, one per sample, unlike a detector's
per-image `out["labels"]`), unless the file pads each batch to its longest
sequence (`padding=True`, a Hugging Face DataCollator, `pad_sequence`) and
the field is gathered batch by batch (not first concatenated over the
batches, which needs one length per rank anyway); and whatever a
DistributedSampler's loader was built over (it pads every rank to the same
count, whichever rows the dataset kept) -- unless the loader's collate_fn
drops samples from each batch (`[b for b in batch if ...]`: junk pairs,
items the dataset returned as None), which leaves each rank's batch its own
size. `generate()` output is as long as the longest sequence of
this rank's batch: gathered into buffers like it, it needs padding to a
common length (`pad_across_processes`, or a pad by the difference).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from assistant.lint.checks.fork import collate_functions
from assistant.lint.checks.wrapper import plain_names
from assistant.lint.model import (
    MOVES,
    Function,
    Script,
    bound_arguments,
    called_name,
    children,
    enclosing_loop,
    name_value_pairs,
    names_given,
    names_in,
    node_fact,
    position,
    short,
    source_text,
    unmoved,
    walk,
)
from assistant.lint.ranks import enclosing_scope, is_rank_expr, is_rank_stride
from assistant.lint.registry import check
from assistant.lint.torchapi import imports_package, is_dist_call
from assistant.results import Finding

# Calls whose result has as many rows as the data makes: a selection, not a map;
# and generation, as long as this rank's longest answer.
CONTENT_SIZED_CALLS = frozenset(
    {"nonzero", "masked_select", "unique", "nms", "batched_nms", "argwhere", "generate"}
)
# Padding to a size every rank shares, by name: Accelerate's.
COMMON_PADDING = frozenset({"pad_across_processes"})
LOADERS = frozenset({"DataLoader"})
# Per-image detection outputs (torchvision, detectron2, mmdet): as many rows as
# objects kept.
DETECTION_KEYS = frozenset({"boxes", "scores", "labels", "masks", "keypoints", "pred_boxes"})
LIKE_BUFFERS = frozenset({"zeros_like", "empty_like", "ones_like", "clone"})
SIZE_READS = frozenset({"len", "size", "numel"})
SIZE_TENSORS = frozenset({"tensor", "as_tensor", "LongTensor", "IntTensor", "new_tensor", "full"})
MAX_DEPTH = 8  # assignments followed back from the gathered tensor (a loader named, a
# shard named, the batch unpacked, the output named: each a step)
# Calls that keep a tensor's rows: `all_gather(bufs, x.detach().contiguous())` gathers x.
ROW_KEEPING_METHODS = MOVES | {"detach", "contiguous", "clone"}


@check("collective-mismatch")
def check_gather_of_content_sized_tensor(script: Script) -> Iterator[Finding]:
    """all_gather into buffers shaped like the local tensor, whose row count
    comes from the data (detections, a mask's selection)."""
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        values = scope_values(nodes)
        sizes_exchanged = False
        for node in nodes:
            if not isinstance(node, ast.Call) or not is_dist_call(
                script.name_of(node.func),
                frozenset(
                    {"all_gather", "all_reduce", "all_gather_into_tensor", "all_gather_object"}
                ),
            ):
                continue
            if short(script.name_of(node.func)) == "all_gather_object":
                # all_gather_object(sizes, x.size(0)): the sizes exchanged as objects
                sizes_exchanged |= any(reads_own_size(a) for a in node.args[1:2])
                continue
            if short(script.name_of(node.func)) != "all_gather" or len(node.args) < 2:
                sizes_exchanged |= any(reads_size(values, a) for a in node.args[:2])
                continue
            buffers, tensor = node.args[0], gathered_name(node.args[1])
            # `keys = np.unique(keys)` after it is no origin, nor one overwritten before it
            values = scope_values(reaching(script, nodes, node))
            if reads_size(values, tensor):
                sizes_exchanged = True  # all_gather(sizes, local_size)
                continue
            if sizes_exchanged or not isinstance(tensor, ast.Name):
                continue
            if not sized_like(values, buffers, tensor.id):
                continue
            if (
                padded_to_a_common_size(values, tensor)
                or listed_scalars(values, tensor)
                or allocated_at_a_common_size(before(nodes, node), values, tensor)
            ):
                continue
            step = content_sized_step(script, values, tensor) or padded_to_its_own_longest(
                values, tensor
            )
            if step is None and isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                step = content_sized_by_callers(script, scope, values, tensor)
            if step is not None and dropping_collate(script, step) is not None:
                # Batches of their own size hold rows the gather must keep apart from
                # a scalar (a loss, gathered and stacked): only rows concatenated count.
                step = step if rows_concatenated(nodes, buffers) else None
            if step is not None:
                yield script.finding(
                    "collective-mismatch",
                    node,
                    f"all_gather({source_text(buffers)}, {tensor.id}): the size of {tensor.id} "
                    f"comes from this rank's data ({describe_step(script, step)}), but every "
                    "rank receives into buffers shaped like its own: the sizes differ across "
                    "ranks (error, hang or garbage); all_gather the sizes first and pad to the "
                    "largest, or use all_gather_object",
                )


def rows_concatenated(nodes: list[ast.AST], buffers: ast.expr) -> bool:
    """`torch.cat(bufs)` in the scope: the gathered parts are rows, not scalars."""
    return isinstance(buffers, ast.Name) and any(
        isinstance(node, ast.Call)
        and called_name(node) in CONCATENATIONS - STACKS
        and node.args
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == buffers.id
        for node in nodes
    )


def gathered_name(tensor: ast.expr) -> ast.expr:
    """The name a gathered expression is made of when only row-keeping calls follow it."""
    name = unmoved(tensor, ROW_KEEPING_METHODS)
    return name if isinstance(name, ast.Name) else tensor


def describe_step(script: Script, step: ast.expr) -> str:
    collate = dropping_collate(script, step)
    if collate is not None:
        name, function = collate
        return (
            f"the loader's collate_fn `{name}` (line {function.lineno}) drops samples "
            f"from each batch, so each rank's batch has its own size"
        )
    ended = grown_until_the_data_says(script, step)
    if ended is not None:
        return (
            f"`{source_text(step)}`, line {step.lineno}, grows what it returns in a loop "
            f"that line {ended.lineno} ends when this rank's own outputs say so"
        )
    if isinstance(step, ast.Attribute) and step.attr in NODE_FIELDS:
        return (
            f"`{source_text(step)}`, line {step.lineno}, one row per node of the graph batch: "
            "as many as this rank's graphs hold"
        )
    if isinstance(step, ast.Call) and called_name(step) in PADDING_CALLS:
        return (
            f"`{source_text(step)}`, line {step.lineno}, pads it to the longest item this "
            "rank measured among its own"
        )
    unpacked_into = script.parents.get(id(step))
    if (
        isinstance(step, ast.Name)
        and isinstance(unpacked_into, ast.Tuple)
        and isinstance(script.parents.get(id(unpacked_into)), ast.For)
    ):
        return (
            f"`{step.id}`, line {step.lineno}, a part of each batch that the file's "
            "collate pads to the batch's own longest item"
        )
    return f"`{source_text(step)}`, line {step.lineno}"


def dropping_collate(script: Script, node: ast.AST) -> tuple[str, Function] | None:
    """(name, function) of the collate_fn of `DataLoader(..., collate_fn=...)` when it drops samples
    from the batch it is given: a comprehension over the batch with a condition,
    or `filter(...)` of it."""
    if not (isinstance(node, ast.Call) and called_name(node) in LOADERS):
        return None
    for qualified, _ in collate_functions(script, node):
        function = script.functions[qualified]
        if drops_from_its_batch(function):
            return qualified, function
    return None


def drops_from_its_batch(function: Function) -> bool:
    parameters = [a.arg for a in function.args.args if a.arg not in ("self", "cls")]
    if not parameters:
        return False
    batch = parameters[0]

    def over_batch(expr: ast.expr) -> bool:
        return isinstance(expr, ast.Name) and expr.id == batch

    def drops(node: ast.AST) -> bool:
        if isinstance(node, ast.ListComp | ast.GeneratorExp):
            return any(over_batch(c.iter) and c.ifs for c in node.generators)
        if isinstance(node, ast.Call) and called_name(node) == "filter":
            return any(over_batch(a) for a in node.args)
        return False

    return any(drops(node) for node in walk(function))


def before(nodes: list[ast.AST], call: ast.Call) -> list[ast.AST]:
    """The scope's nodes that start before `call` (a loop's body after it runs
    before it again only on the next pass, which the data of this one decides)."""
    here = (call.lineno, call.col_offset)
    return [n for n in nodes if (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)) < here]


def reaching(script: Script, nodes: list[ast.AST], call: ast.Call) -> list[ast.AST]:
    """The scope's nodes before `call` (before()), less the assignments that one made
    surely later overwrites: `rows, inter = validate(...)` in the block that holds the
    call (or a block around it) replaces what an earlier loop made of `inter`; an
    assignment that reads the name itself (`local = torch.cat(local)`) replaces nothing."""
    earlier = before(nodes, call)
    surely_ran = statements_before(script, call)
    last: dict[str, tuple[int, int]] = {}
    for node in earlier:
        if isinstance(node, ast.Assign) and id(node) in surely_ran:
            for name in (n for t in node.targets for n in plain_names(t)):
                if name not in names_in(node.value):  # `local = torch.cat(local)` keeps it
                    last[name] = max(last.get(name, (0, 0)), position(node))
    return [
        node
        for node in earlier
        if not (
            isinstance(node, ast.Assign)
            and any(
                position(node) < last.get(name, (0, 0))
                for t in node.targets
                for name in plain_names(t)
            )
        )
    ]


def statements_before(script: Script, node: ast.AST) -> set[int]:
    """Ids of the statements that run before `node` on every path to it: those ahead
    of it, or of a statement around it, in the same list of statements."""
    found: set[int] = set()
    child, parent = node, script.parents.get(id(node))
    while parent is not None:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and any(s is child for s in block):
                found.update(
                    id(s) for s in block[: next(i for i, s in enumerate(block) if s is child)]
                )
        if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
            break
        child, parent = parent, script.parents.get(id(parent))
    return found


def scope_values(nodes: list[ast.AST]) -> dict[str, list[ast.expr]]:
    """name -> what the scope assigns to it (a tuple of values part by part), what it
    appends or extends it with,
    and for a loop variable what the loop iterates (`for x, y in loader`: the
    batches come from the loader, and as many as its data holds)."""
    values: dict[str, list[ast.expr]] = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            # `a, b = torch.cat(a), torch.cat(b)`: each name its own part
            paired = name_value_pairs(node)
            for name, value in paired:
                values.setdefault(name.id, []).append(value)
            taken = {name.id for name, _ in paired}
            for name in (n for t in node.targets for n in plain_names(t) if n not in taken):
                values.setdefault(name, []).append(node.value)
        elif isinstance(node, ast.For):
            for name in plain_names(node.target):
                values.setdefault(name, []).append(node.iter)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            values.setdefault(node.target.id, []).append(node.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend")
            and isinstance(node.func.value, ast.Name)
            and node.args
        ):
            values.setdefault(node.func.value.id, []).append(node.args[0])
    return values


def origin(
    values: dict[str, list[ast.expr]],
    expr: ast.expr,
    stop: Callable[[ast.AST], bool] | None = None,
) -> Iterator[ast.expr]:
    """`expr` and the values of the names in it, MAX_DEPTH assignments back, each once;
    not into what a DistributedSampler's loader was built over, nor into what `stop`
    marks (walk_until)."""

    def stops(node: ast.AST) -> bool:
        return is_equal_share_loader(values, node) or (stop is not None and stop(node))

    seen: set[str] = set()
    frontier = [expr]
    for _ in range(MAX_DEPTH):
        following: list[ast.expr] = []
        for current in frontier:
            yield current
            local = comprehension_names(current)
            for node in walk_until(current, stops, past_callees=True):
                if isinstance(node, ast.Name) and node.id not in seen | local:
                    seen.add(node.id)
                    following.extend(values.get(node.id, []))
        frontier = following
        if not frontier:
            return


def walk_until(
    expr: ast.AST, stop: Callable[[ast.AST], bool], past_callees: bool = False
) -> Iterator[ast.AST]:
    """ast.walk, but not into the nodes `stop` marks (they are yielded themselves);
    `past_callees`: nor into a call's callee named by a plain name (`model(x)`):
    the rows of what a model or function returns come from its arguments, not
    from how the model was built (an embedding sized by a vocabulary's unique())."""
    pending = [expr]
    while pending:
        node = pending.pop()
        yield node
        if stop(node):
            continue
        if past_callees and isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            pending.extend([*node.args, *node.keywords])
        else:
            pending.extend(children(node))


def equal_share_walk(values: dict[str, list[ast.expr]], expr: ast.AST) -> Iterator[ast.AST]:
    """ast.walk, but not into a DataLoader whose sampler is a DistributedSampler:
    it pads every rank to the same number of samples, so the rows its dataset
    kept (a mask, a fold, a rank's stride) no longer differ by rank."""
    return walk_until(expr, lambda node: is_equal_share_loader(values, node))


def is_equal_share_loader(values: dict[str, list[ast.expr]], node: ast.AST) -> bool:
    """`DataLoader(ds, sampler=DistributedSampler(ds))`, the sampler also by name; and
    the DistributedSampler itself (`torch.tensor(list(sampler))`: its indices, padded
    to the same count on every rank)."""
    if isinstance(node, ast.Call) and called_name(node) == "DistributedSampler":
        return True
    if not (isinstance(node, ast.Call) and called_name(node) in LOADERS):
        return False
    sampler = next((k.value for k in node.keywords if k.arg == "sampler"), None)
    if sampler is None:
        return False
    made = [sampler, *values.get(sampler.id, [])] if isinstance(sampler, ast.Name) else [sampler]
    return any(
        isinstance(value, ast.Call) and called_name(value) == "DistributedSampler" for value in made
    )


def comprehension_names(expr: ast.expr) -> set[str]:
    """Names a comprehension in `expr` binds (`for _ in range(world)`): its own, not the
    scope's assignments of the same name."""
    return {
        name.id
        for node in walk(expr)
        if isinstance(node, ast.comprehension)
        for name in walk(node.target)
        if isinstance(name, ast.Name)
    }


# Padding made of "the common size minus mine": `torch.zeros(per - x.size(0), d)`, F.pad.
PADDING_CALLS = frozenset(
    {"zeros", "empty", "full", "ones", "new_zeros", "new_full", "new_empty", "pad"}
)


def padded_to_a_common_size(values: dict[str, list[ast.expr]], tensor: ast.expr) -> bool:
    """The tensor is cut or padded to a size every rank shares before the gather:
    its making holds a padding sized by a difference with its own size, up to a
    length this rank did not measure on its own items."""
    for value in origin(values, tensor):
        for node in walk(value):
            if isinstance(node, ast.Call) and called_name(node) in COMMON_PADDING:
                return True
            if not (isinstance(node, ast.Call) and called_name(node) in PADDING_CALLS):
                continue
            if any(not measured_here(values, target) for target in padded_to(node)):
                return True
    return False


def padded_to_its_own_longest(
    values: dict[str, list[ast.expr]], tensor: ast.expr
) -> ast.Call | None:
    """`F.pad(p, (0, max_len - p.size(1)))` with `max_len = max(p.size(1) for p in
    preds)` of this rank's own batches: padded to this rank's longest, which another
    rank's data need not share."""
    return next(
        (
            node
            for value in origin(values, tensor)
            for node in walk(value)
            if isinstance(node, ast.Call)
            and called_name(node) in PADDING_CALLS
            and any(measured_here(values, target) for target in padded_to(node))
        ),
        None,
    )


def padded_to(padding: ast.Call) -> list[ast.expr]:
    """The lengths a padding call pads to: `L` in each `L - x.size(1)` it holds."""
    return [
        inner.left
        for inner in walk(padding)
        if isinstance(inner, ast.BinOp)
        and isinstance(inner.op, ast.Sub)
        and reads_own_size(inner.right)
    ]


def measured_here(values: dict[str, list[ast.expr]], length: ast.expr) -> bool:
    """The length is the longest (or shortest) of items this scope measured itself."""
    return any(measures_its_items(value) for value in origin(values, length))


# Calls that allocate a tensor of the size they are given.
ALLOCATIONS = frozenset(
    {"zeros", "empty", "ones", "full", "new_zeros", "new_empty", "new_ones", "new_full"}
)


def allocated_at_a_common_size(
    nodes: list[ast.AST], values: dict[str, list[ast.expr]], tensor: ast.Name
) -> bool:
    """The tensor is allocated with a row count that measures no data, or is the
    rounded-up block of a total shared out by rank (`padded =
    torch.zeros(math.ceil(n / world), d)`, `x.new_zeros(ceil(len(texts) / world), d)`)
    and only filled in place after (`padded[: len(x)] = x`): the same size on every
    rank, whatever fills it."""
    allocations = [
        node.value
        for node in nodes
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == tensor.id for t in node.targets)
    ]
    return bool(allocations) and all(
        isinstance(a, ast.Call)
        and called_name(a) in ALLOCATIONS
        and a.args
        and (
            not measures_data(values, rows_of(a.args[0]))
            or rounds_up(values, rows_of(a.args[0]))  # ceil(len(texts) / world): a block
        )
        for a in allocations
    )


def rows_of(size: ast.expr) -> ast.expr:
    """The first dimension of a size given as a tuple or list."""
    return size.elts[0] if isinstance(size, ast.Tuple | ast.List) and size.elts else size


def measures_data(values: dict[str, list[ast.expr]], expr: ast.expr) -> bool:
    """The expression, or what its names hold a few assignments back, reads a length."""
    return any(reads_own_size(value) for value in origin(values, expr))


def listed_scalars(values: dict[str, list[ast.expr]], tensor: ast.Name) -> bool:
    """Every value of the tensor is made from a list of its elements written out
    (`torch.tensor([history[-1] if alive else -1.0])`): as many as the list shows,
    on every rank, whatever data the elements were picked from."""
    made = values.get(tensor.id, [])
    return bool(made) and all(
        isinstance(value, ast.Call)
        and called_name(value) in ("tensor", "as_tensor", "Tensor")
        and value.args
        and isinstance(value.args[0], ast.List | ast.Tuple)
        and all(scalar_element(values, e) for e in value.args[0].elts)
        for value in map(unmoved, made)
    )


def scalar_element(values: dict[str, list[ast.expr]], element: ast.expr) -> bool:
    """An element that is one number: not a list or starred, nor a name the scope
    fills as a list."""
    if isinstance(element, ast.Starred | ast.List | ast.Tuple | ast.ListComp):
        return False
    if isinstance(element, ast.Name):
        return (
            not any(
                isinstance(v, ast.List | ast.ListComp | ast.Tuple)
                for v in values.get(element.id, [])
            )
            and len(values.get(element.id, [])) <= 1
        )
    return True


def reads_own_size(expr: ast.expr) -> bool:
    """`x.size(0)`, `x.shape[0]`, `len(x)`, `x.numel()`."""
    for node in walk(expr):
        if isinstance(node, ast.Call) and called_name(node) in SIZE_READS:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "shape":
            return True
    return False


def content_sized_step(
    script: Script, values: dict[str, list[ast.expr]], tensor: ast.expr, depth: int = 0
) -> ast.expr | None:
    """The step in the tensor's making whose size depends on the data; followed into
    what the file's own functions return, RETURN_DEPTH calls deep."""
    batches = loader_batches(values)
    own_lengths = batches_of_their_own_length(script)
    lengths_differ = own_lengths and gathered_per_batch(values, tensor, batches)
    if own_lengths and batches:
        token_output = per_token_output_per_batch(values, tensor, batches)
        if token_output is not None:
            return token_output  # (batch, its longest sequence) of start_logits
        flattened = steps_flattened_into_rows(values, tensor, batches)
        if flattened is not None:
            return flattened  # (batch x its length) rows of frame features

    padded = padded_fields(script, values) if own_lengths else {}
    if padded:
        field = padded_field_per_batch(values, tensor, padded)
        if field is not None:
            return field  # (batch, its longest, ...): padded per batch

    def fixes_the_size(node: ast.AST) -> bool:
        return fixes_the_rows(node) or cuts_generated_to_a_length(values, node)

    if batches and imports_package(script, "torch_geometric"):
        field = node_field_reaching(values, tensor, batches)
        if field is not None:
            return field  # one row per atom or node: as many as this rank's graphs hold
    for value in origin(values, tensor, stop=fixes_the_size):
        for node in equal_share_walk(values, value):
            if is_batch_field(node, batches):
                if lengths_differ:
                    return node  # (batch, its longest sequence): rows agree, lengths not
                continue  # batch["labels"]: one per sample
            if (
                is_content_sized(node)
                or is_mask_selection(script, values, node)
                or is_rank_stride(script, node)
                or is_clipped_rank_block(script, values, node)
                or is_uneven_split_share(script, values, node)
                or returns_a_rank_share(script, node)
                or appended_when_the_data_says(script, node)
                or grown_until_the_data_says(script, node) is not None
            ):
                return node
            if depth < RETURN_DEPTH and (inner := returned_content_sized(script, node, depth)):
                return inner
            if dropping_collate(script, node) is not None:
                return node
    return None


RETURN_DEPTH = 2  # main() -> evaluate(loader) -> matches(batch): where the rows are kept


def returned_content_sized(script: Script, node: ast.AST, depth: int) -> ast.expr | None:
    """The content-sized step in what a function of the file returns, called here
    (`local = epipolar_errors(model, loader)`, which concatenates the errors of the
    matches each pair kept by a mask)."""
    function = script.function_called(node)
    if function is None:
        return None
    nodes = script.scope_nodes(function)
    returned = [n.value for n in nodes if isinstance(n, ast.Return) and n.value is not None]
    # a tensor it makes (`torch.cat(errs) if errs else torch.zeros(0, 3)`), not a tuple,
    # a dataset or a frame handed along the way (those rows are not the gathered ones)
    if not returned or not all(makes_a_tensor(value) for value in returned):
        return None
    values = scope_values(nodes)
    for value in returned:
        step = content_sized_step(script, values, value, depth + 1)
        if step is not None:
            return step
    return share_handed_in(script, node, function, returned, depth)


def share_handed_in(
    script: Script, call: ast.Call, function: Function, returned: list[ast.expr], depth: int
) -> ast.expr | None:
    """The content-sized step in what the call hands a parameter that the function's
    rows are collected over: `target_ranks(net, my_users)` whose loop over `users`
    appends a row per user to the list it returns joined, given `my_users =
    list(range(rank, n, world))` (in the calling function or the one around it)."""
    joined = {
        value.args[0].id
        for value in returned
        if isinstance(value, ast.Call)
        and called_name(value) in CONCATENATIONS
        and value.args
        and isinstance(value.args[0], ast.Name)
    }
    parameters = {a.arg for a in function.args.args}
    collected_over = {
        name
        for loop in script.scope_nodes(function)
        if isinstance(loop, ast.For) and appends_to(loop, joined)
        for name in names_in(loop.iter) & parameters
    }
    if not collected_over:
        return None
    values = values_around(script, call)
    for parameter, argument in bound_arguments(function, call):
        if parameter in collected_over:
            step = content_sized_step(script, values, argument, depth + 1)
            if step is not None:
                return step
    return None


def appends_to(loop: ast.For, names: set[str]) -> bool:
    """The loop appends to (or extends) one of `names` each pass."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("append", "extend")
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id in names
        for n in walk(loop)
    )


def values_around(script: Script, node: ast.AST) -> dict[str, list[ast.expr]]:
    """scope_values where `node` is, with the names a nested function reads from the
    function around it (`my_users` of main, read in main's `def gather_ranks():`)."""
    scope = enclosing_scope(node, script) or script.tree
    values = scope_values(script.scope_nodes(scope))
    if scope is not script.tree:
        outer = enclosing_scope(scope, script) or script.tree
        for name, made in scope_values(script.scope_nodes(outer)).items():
            values.setdefault(name, made)
    return values


def makes_a_tensor(value: ast.expr) -> bool:
    """The returned expression is a tensor the function makes: a join, an allocation
    or a selection (`x[keep]`), reshaped or not, on either side of an `a if c else b`."""
    if isinstance(value, ast.IfExp):
        return makes_a_tensor(value.body) and makes_a_tensor(value.orelse)
    value = reshaped_from(value)
    if isinstance(value, ast.Subscript):
        return True
    return isinstance(value, ast.Call) and called_name(value) in TENSOR_MAKING_CALLS


# A collation that pads each batch to its own longest sequence.
PADS_TO_LONGEST = re.compile(
    r"padding\s*=\s*(?:True|['\"]longest['\"])|\bDataCollator\w*|\bpad_sequence\b"
)
CONCATENATIONS = frozenset({"cat", "concat", "concatenate", "stack", "vstack", "hstack"})
# Calls that make a tensor of their own: joins, allocations, conversions.
TENSOR_MAKING_CALLS = (
    CONCATENATIONS | ALLOCATIONS | {"tensor", "as_tensor", "from_numpy", "where", "nonzero"}
)
STACKS = frozenset({"stack", "hstack"})  # of gathered scalars too: a new axis, not more rows


def batches_of_their_own_length(script: Script) -> bool:
    """The file makes each batch as long as its own items: a padding option or
    collator that pads to the longest sequence, or a collate function of its own
    (by its name, or as a loader's collate_fn) that measures its items' longest or
    shortest length (`L = max(it["input_ids"].shape[0] for it in items)`, or
    `n = min(len(w) for w in batch)`, every waveform cropped to the shortest). Worked
    out once per file: each gather of it asks."""
    return node_fact(script.tree, "batches of their own length", lambda: own_lengths(script))


def own_lengths(script: Script) -> bool:
    collates = {
        name
        for call, called in script.call_names
        if short(called) in LOADERS
        for name, _ in collate_functions(script, call)
    }
    return bool(PADS_TO_LONGEST.search(script.source)) or any(
        (is_collate_name(name) or name in collates) and measures_its_items(function)
        for name, function in script.functions.items()
    )


def is_collate_name(qualified: str) -> bool:
    """`collate_fn`, `pad_collate`, or the `__call__` of a collator class (`Collate`,
    `ContactCollator`)."""
    owner, _, name = qualified.rpartition(".")
    if name == "__call__":
        name = owner.rsplit(".", 1)[-1]
    return "collat" in name.lower()


def padded_fields(script: Script, values: dict[str, list[ast.expr]]) -> dict[str, ast.Name]:
    """Names a loop over a loader unpacks from the places of its batch that a collate of
    the file pads to the batch's own longest item (`for idx, tokens, tgt, msk in
    loader`, where the collate returns `tgt = torch.zeros(n, L, L)` with `L = max(len(s)
    for s in seqs)`), each with where the loop binds it: each batch, and each rank's,
    has its own size there."""
    places = padded_places(script)
    return {
        element.id: element
        for iterated in {id(v): v for made in values.values() for v in made}.values()
        if is_loader(values, iterated)
        for loop in script.of_type(ast.For)
        if loop.iter is iterated and isinstance(loop.target, ast.Tuple)
        for index, element in enumerate(loop.target.elts)
        if isinstance(element, ast.Name) and (len(loop.target.elts), index) in places
    }


def padded_field_per_batch(
    values: dict[str, list[ast.expr]], tensor: ast.expr, padded: dict[str, ast.Name]
) -> ast.Name | None:
    """Where the loop binds a padded field that reaches the tensor batch by batch, not
    first concatenated over the batches (`torch.cat(preds)` of a model's one row per
    sample needs one length per rank anyway)."""

    def concatenated(node: ast.AST) -> bool:
        """A join of a list made elsewhere (`torch.cat(preds)`), not of this batch's
        parts written out (`torch.stack([probs, tgt[0]])`)."""
        return (
            isinstance(node, ast.Call)
            and called_name(node) in CONCATENATIONS
            and bool(node.args)
            and not isinstance(node.args[0], ast.List | ast.Tuple)
        )

    def shaped_elsewhere(node: ast.AST) -> bool:
        """A call whose result's shape is its own (a model's, a decoder's fixed-length
        output), other than a join written out or a call that keeps the rows."""
        if not isinstance(node, ast.Call):
            return False
        name = called_name(node)
        return concatenated(node) or not (name in CONCATENATIONS or name in FIELD_KEEPING)

    if joined_under_its_name(values, tensor, concatenated):
        return None
    reaching = first_reaching(
        values, tensor, shaped_elsewhere, lambda n: isinstance(n, ast.Name) and n.id in padded
    )
    return padded[reaching.id] if isinstance(reaching, ast.Name) else None


def joined_under_its_name(
    values: dict[str, list[ast.expr]], tensor: ast.expr, concatenated: Callable[[ast.AST], bool]
) -> bool:
    """`hits = torch.cat(hits)`: a list appended to batch by batch, then joined under its
    own name, holds all the rank's batches, whatever each batch's own size."""
    return isinstance(tensor, ast.Name) and any(
        concatenated(value) and tensor.id in names_in(value) for value in values.get(tensor.id, [])
    )


def first_reaching(
    values: dict[str, list[ast.expr]],
    tensor: ast.expr,
    stops: Callable[[ast.AST], bool],
    accepts: Callable[[ast.AST], bool],
) -> ast.AST | None:
    """The first node `accepts` takes among those that reach the tensor: its origin and
    each value's nodes, read until a call `stops` (a model's, one that shapes its own
    output) ends that path."""
    return next(
        (
            node
            for value in origin(values, tensor, stops)
            for node in walk_until(value, stops)
            if accepts(node)
        ),
        None,
    )


# Calls through which a padded field keeps its padded size: moves, casts, copies.
FIELD_KEEPING = ROW_KEEPING_METHODS | {"long", "int", "bool", "double", "cpu"}


def padded_places(script: Script) -> set[tuple[int, int]]:
    """(length of the returned tuple, place) of what the file's collates return padded to
    the longest item they measured, or by pad_sequence. Worked out once per file."""
    return node_fact(script.tree, "padded places", lambda: collate_padded_places(script))


def collate_padded_places(script: Script) -> set[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for name, function in script.functions.items():
        if not is_collate_name(name):
            continue
        nodes = script.scope_nodes(function)
        measured = names_given(nodes, measures_its_items)
        values = scope_values(nodes)
        for node in nodes:
            if not (isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)):
                continue
            for index, part in enumerate(node.value.elts):
                if any(
                    names_in(made) & measured or pads_to_the_longest(made)
                    for made in origin(values, part)
                ):
                    found.add((len(node.value.elts), index))
    return found


def pads_to_the_longest(value: ast.expr) -> bool:
    """`pad_sequence(ys, batch_first=True)`: as long as the batch's longest item."""
    return any(isinstance(n, ast.Call) and called_name(n) == "pad_sequence" for n in walk(value))


def measures_its_items(code: ast.AST) -> bool:
    """`max(len(x) for x in items)`, `min(t.shape[0] for t in ...)`, `.size(0)` too, in a
    function or an expression."""
    return any(
        isinstance(node, ast.Call)
        and called_name(node) in ("max", "min")
        and len(node.args) == 1
        and isinstance(node.args[0], ast.GeneratorExp | ast.ListComp)
        and reads_own_size(node.args[0].elt)
        for node in walk(code)
    )


def steps_flattened_into_rows(
    values: dict[str, list[ast.expr]], tensor: ast.expr, batches: set[str]
) -> ast.expr | None:
    """`h.reshape(-1, h.size(-1))` (or `.view(-1, d)`, `.flatten(0, 1)`) of what a
    model made of a loader's batch: one row per sample and step, as many as the
    batch is long, and each batch is as long as its own items; concatenated over the
    batches, still a count of this rank's own."""
    for value in origin(values, tensor):
        for node in walk(value):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if flattens_the_leading_axes(node) and any(
                names_in(made) & batches for made in origin(values, node.func.value)
            ):
                return node
    return None


def flattens_the_leading_axes(call: ast.Call) -> bool:
    """`.reshape(-1, d)`, `.view(-1, d)`, `.flatten(0, 1)`, `.flatten(end_dim=1)`."""
    method, args = call.func.attr, call.args  # type: ignore[union-attr]
    if method in ("reshape", "view") and len(args) == 2:
        first = args[0]
        return (
            isinstance(first, ast.UnaryOp)
            and isinstance(first.op, ast.USub)
            and isinstance(first.operand, ast.Constant)
            and first.operand.value == 1
        )
    if method == "flatten":
        ends = [k.value for k in call.keywords if k.arg == "end_dim"] or args[1:2]
        return any(isinstance(end, ast.Constant) and end.value == 1 for end in ends)
    return False


def gathered_per_batch(
    values: dict[str, list[ast.expr]], tensor: ast.expr, batches: set[str]
) -> bool:
    """A batch's field reaches the tensor without a concatenation over batches (a
    list appended to batch by batch, then joined under its own name: `golds =
    torch.cat(golds)`, is joined)."""

    def concatenated(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and called_name(node) in CONCATENATIONS

    if joined_under_its_name(values, tensor, concatenated):
        return False
    return (
        first_reaching(values, tensor, concatenated, lambda n: is_batch_field(n, batches))
        is not None
    )


# A model's outputs with one row per token: as long as the batch's longest sequence.
PER_TOKEN_OUTPUTS = frozenset({"start_logits", "end_logits", "last_hidden_state"})


def per_token_output_per_batch(
    values: dict[str, list[ast.expr]], tensor: ast.expr, batches: set[str]
) -> ast.expr | None:
    """`out.start_logits` (row-keeping calls around it aside) of a model run on a
    loader's batch, reaching the tensor batch by batch: a QA model's span logits or
    an encoder's token states, shaped (batch, the batch's longest sequence)."""

    def concatenated(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and called_name(node) in CONCATENATIONS

    found = None
    reads_a_batch = False
    for value in origin(values, tensor, concatenated):
        kept = unmoved(value, ROW_KEEPING_METHODS)
        if found is None and isinstance(kept, ast.Attribute) and kept.attr in PER_TOKEN_OUTPUTS:
            found = kept
        reads_a_batch |= bool(names_in(value) & batches)
    return found if reads_a_batch else None


LOADER_NAME = re.compile(r"loader|(?<![a-z])dl(?![a-z])", re.IGNORECASE)


def loader_batches(values: dict[str, list[ast.expr]]) -> set[str]:
    """Names a loop binds to a loader's batches: `for batch in val_loader` (a loader by
    its name, or made by a DataLoader call)."""
    return {name for name, made in values.items() for value in made if is_loader(values, value)}


def is_loader(values: dict[str, list[ast.expr]], expr: ast.expr) -> bool:
    if isinstance(expr, ast.Call) and called_name(expr) == "enumerate" and expr.args:
        expr = expr.args[0]  # for i, batch in enumerate(loader)
    if isinstance(expr, ast.Name | ast.Attribute):
        named = expr.id if isinstance(expr, ast.Name) else expr.attr
        if LOADER_NAME.search(named):
            return True
        if isinstance(expr, ast.Name):
            return any(
                isinstance(v, ast.Call) and called_name(v) in LOADERS
                for v in values.get(expr.id, [])
            )
    return isinstance(expr, ast.Call) and called_name(expr) in LOADERS


# A PyTorch Geometric batch's fields with one row per node (atom), not per graph.
NODE_FIELDS = frozenset({"x", "pos", "z", "forces", "force", "atomic_numbers", "batch"})


# Tensor methods that keep a tensor's rows (`(f - data.forces).norm(dim=-1)`).
ROW_WISE_METHODS = FIELD_KEEPING | frozenset(
    {"abs", "norm", "pow", "sqrt", "square", "sum", "mean", "amax", "clamp", "reshape", "view"}
)


def node_field_reaching(
    values: dict[str, list[ast.expr]], tensor: ast.expr, batches: set[str]
) -> ast.Attribute | None:
    """A graph batch's per-node field that reaches the tensor row for row, through joins
    and row-wise methods, not through a model's call (which pools the nodes of each graph
    as it likes)."""

    def stops(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        if isinstance(node.func, ast.Attribute) and node.func.attr in ROW_WISE_METHODS:
            return False
        return called_name(node) not in CONCATENATIONS

    found = first_reaching(values, tensor, stops, lambda n: is_node_field(n, batches))
    return found if isinstance(found, ast.Attribute) else None


def is_node_field(node: ast.AST, batches: set[str]) -> bool:
    """`data.forces` of a graph batch a loader yields: its rows are the batch's nodes, a
    number each batch (and each rank's share of graphs) has of its own."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in NODE_FIELDS
        and isinstance(node.value, ast.Name)
        and node.value.id in batches
    )


def is_batch_field(node: ast.AST, batches: set[str]) -> bool:
    """`batch["labels"]` read off a loader's collated batch: a tensor with one row
    per sample, not a detector's per-image list."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id in batches
        and isinstance(node.slice, ast.Constant)
    )


CALLER_LEVELS = 2  # main() -> knn_monitor(loader) -> gather_features(loader)


def content_sized_by_callers(
    script: Script,
    function: ast.FunctionDef | ast.AsyncFunctionDef,
    values: dict[str, list[ast.expr]],
    tensor: ast.expr,
    levels: int = CALLER_LEVELS,
) -> ast.expr | None:
    """The content-sized step in what this file's callers pass for a parameter the
    tensor is made from: `gather_features(encoder, loader)` called with a loader
    over `Subset(ds, range(rank, n, world))`, up to CALLER_LEVELS calls up."""
    used = {
        n.id
        for v in origin(values, tensor)
        for n in walk_until(v, lambda node: is_equal_share_loader(values, node), past_callees=True)
        if isinstance(n, ast.Name)
    }  # not what a DistributedSampler or its loader is built over: every rank gets a share
    for scope, caller_values, argument in caller_arguments(script, function, used):
        step = content_sized_step(script, caller_values, argument)
        if (
            step is None
            and levels > 1
            and isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef)
        ):
            step = content_sized_by_callers(script, scope, caller_values, argument, levels - 1)
        if step is not None:
            return step
    return None


def caller_arguments(script: Script, function: ast.AST, parameters: set[str]):
    """(the calling scope, its values before the call, the argument) for each argument
    that a call of `function` in the file passes to one of `parameters` (`q_pid =
    q_pid[real]` after `gather(q_pid)` is not what was gathered)."""
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        calls = [
            n
            for n in nodes
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == function.name
        ]
        for call in calls:
            values = scope_values(reaching(script, nodes, call))
            for parameter, argument in bound_arguments(function, call):
                if parameter in parameters:
                    yield scope, values, argument


def returns_a_rank_share(script: Script, node: ast.AST) -> bool:
    """A call of the file's own function that returns this rank's strided share or
    clipped block (`def shard(n, rank, world): return np.arange(n)[rank::world]`)."""
    function = script.function_called(node)
    if function is None:
        return False
    nodes = script.scope_nodes(function)
    values = scope_values(nodes)
    return any(
        is_rank_stride(script, part)
        or is_clipped_rank_block(script, values, part)
        or is_uneven_split_share(script, values, part)
        for returned in nodes
        if isinstance(returned, ast.Return) and returned.value is not None
        for value in origin(values, returned.value)
        for part in walk(value)
    )


# Splits into a number of parts that may differ in length by one (np.array_split,
# torch.tensor_split) or leave the last part short (torch.chunk); not np.split, which
# refuses a length that does not divide.
UNEVEN_SPLITS = frozenset({"array_split", "tensor_split", "chunk"})


def is_uneven_split_share(script: Script, values: dict[str, list[ast.expr]], node: ast.AST) -> bool:
    """`np.array_split(idx, world)[rank]`: this rank's part of a split into as many
    parts as ranks, one shorter on some ranks unless the length divides evenly; the
    split also kept under a name first, or mapped part by part (`bounds = [(c[0],
    c[-1] + 1) for c in torch.tensor_split(rows, world)]`, then `bounds[rank]`: this
    rank's part's ends, as uneven as the parts)."""
    if not (
        isinstance(node, ast.Subscript)
        and not isinstance(node.slice, ast.Slice)
        and is_rank_expr(node.slice, script)
    ):
        return False
    split = node.value
    if isinstance(split, ast.Name):
        return any(is_uneven_split(value) for value in values.get(split.id, ())[:1])
    return is_uneven_split(split)


def is_uneven_split(expr: ast.expr) -> bool:
    """A call of UNEVEN_SPLITS, as it is, listed, or mapped part by part."""
    if isinstance(expr, ast.ListComp | ast.GeneratorExp) and len(expr.generators) == 1:
        expr = expr.generators[0].iter
    elif isinstance(expr, ast.Call) and called_name(expr) in ("list", "tuple") and expr.args:
        expr = expr.args[0]
    return isinstance(expr, ast.Call) and called_name(expr) in UNEVEN_SPLITS


def is_clipped_rank_block(script: Script, values: dict[str, list[ast.expr]], node: ast.AST) -> bool:
    """`range(rank * per, min(n, (rank + 1) * per))` or `items[start:end]` with
    `end = n if rank == world - 1 else start + per`: this rank's contiguous block,
    whose end is clipped to the length or stretched for the last rank, so the
    last rank holds fewer (or more) items unless the length divides evenly; the
    same for a slice of blocks of `ceil(n / world)` items, which Python's slicing
    clips at the end. A block of `n // world` items each, not clipped, is the same
    size everywhere."""
    if isinstance(node, ast.Call) and called_name(node) == "range" and len(node.args) == 2:
        start, end = node.args
    elif (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Slice)
        and node.slice.step is None
        and node.slice.lower is not None
        and node.slice.upper is not None
    ):
        start, end = node.slice.lower, node.slice.upper
    else:
        return False
    sliced = isinstance(node, ast.Subscript)
    if sliced and padded_with_its_own_head(values, node.value):
        return False  # padded to blocks * ranks first: no block is short
    return reads_rank(script, values, start) and (
        is_clipped(values, end) or (sliced and rounds_up(values, end))
    )


def padded_with_its_own_head(values: dict[str, list[ast.expr]], sliced: ast.expr) -> bool:
    """`padded = indices + indices[:total - len(indices)]`: the list wrapped around
    to a whole number of blocks, as DistributedSampler pads, so that every rank's
    block of `ceil(n / world)` items is whole."""
    if not isinstance(sliced, ast.Name):
        return False
    for value in values.get(sliced.id, ())[:1]:
        if (
            isinstance(value, ast.BinOp)
            and isinstance(value.op, ast.Add)
            and isinstance(value.right, ast.Subscript)
            and isinstance(value.right.slice, ast.Slice)
            and source_text(value.right.value) == source_text(value.left)
        ):
            return True
    return False


def rounds_up(values: dict[str, list[ast.expr]], expr: ast.expr) -> bool:
    """A block size rounded up, here or in the value of a name it reads:
    `math.ceil(n / world)`, `(n + world - 1) // world`, `-(-n // world)`."""
    followed = [expr, *(v for n in sorted(names_in(expr)) for v in values.get(n, ())[:1])]
    for value in followed:
        for node in walk(value):
            if isinstance(node, ast.Call) and called_name(node) == "ceil":
                return True
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.FloorDiv)
                and isinstance(node.left, ast.BinOp)
                and (
                    (  # n + (world - 1)
                        isinstance(node.left.op, ast.Add)
                        and isinstance(node.left.right, ast.BinOp)
                        and isinstance(node.left.right.op, ast.Sub)
                    )
                    or (  # (n + world) - 1, as Python reads n + world - 1
                        isinstance(node.left.op, ast.Sub)
                        and isinstance(node.left.left, ast.BinOp)
                        and isinstance(node.left.left.op, ast.Add)
                    )
                )
            ):
                return True  # (n + world - 1) // world
            if (
                isinstance(node, ast.UnaryOp)
                and isinstance(node.op, ast.USub)
                and isinstance(node.operand, ast.BinOp)
                and isinstance(node.operand.op, ast.FloorDiv)
                and isinstance(node.operand.left, ast.UnaryOp)
            ):
                return True  # -(-n // world)
    return False


def reads_rank(script: Script, values: dict[str, list[ast.expr]], expr: ast.expr) -> bool:
    """The rank is read in `expr`, or in the value of a name it reads (one step back)."""
    followed = [expr, *(v for n in sorted(names_in(expr)) for v in values.get(n, ())[:1])]
    return any(
        isinstance(part, ast.expr) and is_rank_expr(part, script)
        for value in followed
        for part in walk(value)
    )


def is_clipped(values: dict[str, list[ast.expr]], end: ast.expr) -> bool:
    """`min(n, ...)`, or a conditional end (`n if last else start + per`), here or
    in the value of the name the end is."""
    followed = [end, *(values.get(end.id, ())[:1] if isinstance(end, ast.Name) else ())]
    return any(
        isinstance(value, ast.IfExp)
        or (isinstance(value, ast.Call) and called_name(value) == "min")
        for value in followed
    )


def fixes_the_rows(node: ast.AST) -> bool:
    """`scores.topk(k)`: k rows on every rank, whatever the rows it picks from."""
    return isinstance(node, ast.Call) and called_name(node) == "topk"


def cuts_generated_to_a_length(values: dict[str, list[ast.expr]], node: ast.AST) -> bool:
    """`out[:, 1:n + 1]` of `out = model.generate(...)`: the generated sequences cut
    to a length every rank shares (generate's rows are the batch's; only its length
    is this rank's own)."""
    if not (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Tuple)
        and len(node.slice.elts) >= 2
        and isinstance(node.slice.elts[1], ast.Slice)
        and node.slice.elts[1].upper is not None
    ):
        return False
    made = [node.value]
    if isinstance(node.value, ast.Name):
        made = values.get(node.value.id, [])
    return bool(made) and all(
        isinstance(value, ast.Call) and called_name(value) == "generate" for value in made
    )


def appended_when_the_data_says(script: Script, node: ast.AST) -> bool:
    """`node` is what a loop appends to a list only when a test on that pass's data
    holds (`if "episode" in info: finished.append(r)`, a filter on each item): the
    list's length is each rank's own. A test on a range counter (`if step % 10 ==
    0`) or on options keeps every rank's count the same."""
    call = script.parents.get(id(node))
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "append"
        and node in call.args
    ):
        return False
    tests: list[ast.expr] = []
    parent = script.parents.get(id(call))
    while parent is not None and not isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
        if isinstance(parent, ast.If):
            tests.append(parent.test)
        elif isinstance(parent, ast.For) and tests:
            return any(names_in(test) & per_pass_names(parent) for test in tests)
        parent = script.parents.get(id(parent))
    return False


def grown_until_the_data_says(script: Script, node: ast.AST) -> ast.stmt | None:
    """`node` calls the file's own function that returns a tensor it grows in a loop
    (`x = torch.cat([x, nxt[:, None]], 1)`, a hand-written sampler or beam search;
    returned as it is or reshaped: `y.view(B, k, -1)`) which that
    pass's outputs can end early (`if done.all(): break`, `while not done.all()`):
    each rank stops at its own length. The statement that ends it, else None. A
    loop of a fixed number of steps, or one ended by a counter, keeps the lengths."""
    function = script.function_called(node)
    if function is None:
        return None
    nodes = script.scope_nodes(function)
    returned = {
        base.id
        for n in nodes
        if isinstance(n, ast.Return)
        and n.value is not None
        and isinstance(base := reshaped_from(n.value), ast.Name)
    }
    for loop in (n for n in nodes if isinstance(n, ast.For | ast.While)):
        grown = {name for name in returned if grows(loop, name)}
        ended = ended_by_its_outputs(script, loop, grown) if grown else None
        if ended is not None:
            return ended
    return None


# Methods that keep a tensor's data, whatever shape they give it.
RESHAPES = frozenset({"view", "reshape", "contiguous", "detach", "cpu", "clone"})


def reshaped_from(value: ast.expr) -> ast.expr:
    """`y` of `y.view(B, k, -1)` or `y.contiguous()`: what the reshaping is of."""
    return unmoved(value, RESHAPES)


def grows(loop: ast.For | ast.While, name: str) -> bool:
    """The loop assigns `name` a concatenation of itself and more (`x = torch.cat([x, y], 1)`)."""
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        and isinstance(node.value, ast.Call)
        and called_name(node.value) in CONCATENATIONS
        and name in names_in(node.value)
        for node in walk(loop)
    )


def ended_by_its_outputs(
    script: Script, loop: ast.For | ast.While, grown: set[str]
) -> ast.stmt | None:
    """The `while` whose test, or the `if ...: break` (or return) of this loop whose
    test, reads what the loop computes each pass: not a counter (`step += 1`), nor
    the grown tensor itself (`x.size(1) >= max_len` grows alike on every rank)."""
    computed = computed_each_pass(loop) - grown
    if isinstance(loop, ast.While) and names_in(loop.test) & computed:
        return loop
    for node in walk(loop):
        if (
            isinstance(node, ast.If)
            and any(isinstance(s, ast.Break | ast.Return) for s in node.body)
            and enclosing_loop(node, script.parents) is loop
            and names_in(node.test) & computed
        ):
            return node
    return None


def computed_each_pass(loop: ast.For | ast.While) -> set[str]:
    """Names the loop's body assigns from a call, or from another such name
    (`nxt = torch.multinomial(...)`, `done |= nxt == EOS`); not a counter."""
    assignments = [
        (names_in(target), node.value)
        for node in walk(loop)
        if isinstance(node, ast.Assign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    ]
    computed: set[str] = set()
    for _ in range(2):  # a name made from one assigned later in the body, on the next pass
        for targets, value in assignments:
            if any(isinstance(n, ast.Call) for n in walk(value)) or names_in(value) & computed:
                computed |= targets
    return computed


def per_pass_names(loop: ast.For) -> set[str]:
    """Names a loop gives new data each pass: its own variables (unless it counts
    through a range) and what its body assigns."""
    names = set() if counts(loop) else names_in(loop.target)
    for node in walk(loop):
        if isinstance(node, ast.Assign):
            names |= {n for t in node.targets for n in names_in(t)}
        elif isinstance(node, ast.For) and node is not loop and not counts(node):
            names |= names_in(node.target)
    return names


def counts(loop: ast.For) -> bool:
    """`for step in range(n)`: a counter, the same on every rank."""
    return isinstance(loop.iter, ast.Call) and called_name(loop.iter) == "range"


def is_content_sized(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        called = called_name(node)
        if called in CONTENT_SIZED_CALLS:
            return True
        if called == "where" and len(node.args) == 1:  # torch.where(cond): indices
            return True
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and key.value in DETECTION_KEYS:
            return True
        if isinstance(key, ast.Compare):  # x[x > threshold]
            return True
    return False


# Methods and functions whose result is a boolean mask, like a comparison.
MASK_CALLS = frozenset(
    {"eq", "ne", "gt", "ge", "lt", "le", "isin", "logical_and", "logical_or", "logical_not", "bool"}
)


def is_mask_selection(script: Script, values: dict[str, list[ast.expr]], node: ast.AST) -> bool:
    """`x[keep]` where the scope made `keep` a boolean mask (`keep = conf >= t`,
    `~seen`, `a & b`, `scores.gt(t)`, or a function of the file that returns one):
    the rows it selects are as many as the data has true, like `x[x > t]` inline."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name)):
        return False
    return any(
        is_mask(value) or returns_a_mask(script, value) for value in values.get(node.slice.id, [])
    )


def returns_a_mask(script: Script, value: ast.expr) -> bool:
    """A call of the file's own function that returns a comparison (`def
    fabric_mask(x, grid, thr): return pooled(x, grid) > thr`)."""
    function = script.function_called(value)
    return function is not None and any(
        isinstance(node, ast.Return) and node.value is not None and is_mask(node.value)
        for node in script.scope_nodes(function)
    )


def is_mask(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Compare):
        return True
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Invert):
        return is_mask(expr.operand)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitAnd | ast.BitOr):
        return is_mask(expr.left) or is_mask(expr.right)
    return isinstance(expr, ast.Call) and called_name(expr) in MASK_CALLS


def sized_like(values: dict[str, list[ast.expr]], buffers: ast.expr, tensor: str) -> bool:
    """The receive buffers are made from the local tensor: `[zeros_like(t) for ...]`."""
    made = [buffers, *values.get(buffers.id, [])] if isinstance(buffers, ast.Name) else [buffers]
    for value in made:
        for node in walk(value):
            if not isinstance(node, ast.Call):
                continue
            called = called_name(node)
            if called not in LIKE_BUFFERS:
                continue
            source = node.args[0] if node.args and called != "clone" else node.func
            if any(isinstance(n, ast.Name) and n.id == tensor for n in walk(source)):
                return True
    return False


def reads_size(values: dict[str, list[ast.expr]], expr: ast.expr) -> bool:
    """A small tensor made of a length or a shape (`torch.tensor([len(dets)])`):
    the sizes a padded gather exchanges first."""
    made = [expr, *values.get(expr.id, [])] if isinstance(expr, ast.Name) else [expr]
    for value in made:
        if not (isinstance(value, ast.Call) and called_name(value) in SIZE_TENSORS):
            continue
        for node in walk(value):
            if isinstance(node, ast.Attribute) and node.attr == "shape":
                return True
            if isinstance(node, ast.Call) and called_name(node) in SIZE_READS:
                return True
    return False
