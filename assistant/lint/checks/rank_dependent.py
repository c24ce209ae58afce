"""Collectives every rank calls, but with tensors or a number of calls that depend on the rank.

`t = torch.zeros(rank + 1); dist.all_reduce(t)` is called by every rank, yet
rank 0 sends one element and rank 1 two: gloo waits until its timeout
("Timed out waiting ...ms for send operation"), NCCL hangs or reads past the
buffer (collective-mismatch). `for b in batches:
dist.all_reduce(b)` over a list whose length depends on the rank runs the
collective a different number of times on each rank: the ranks with more
items hang (uneven-inputs).

One check finds both, in one walk of the data flow within each function
(module level counts as one): in source order it notes which names hold a
rank-dependent value (`n = rank + 1`, `10 if rank == 0 else 5`,
`int(os.environ["RANK"])`), which hold a tensor whose shape or dtype comes
from one (`torch.zeros(n)`, `.to(torch.half if rank else torch.float)`) and
which a list whose length does (`[... for _ in range(rank)]`), then looks at
each collective that no rank test keeps from some ranks.

Silence where the rank only places or labels things: a device (`.to(rank)`,
f"cuda:{local_rank}", device=rank), a seed, a log line, a sampler, a slice of
a dataset, the value (not the shape) of a tensor (`torch.tensor([rank])`), the
gather/scatter list that only the root passes, and all_to_all's split sizes,
which may differ by design. A value that went through a collective
(`dist.all_reduce(size)`) is the same on every rank afterwards.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from assistant.lint.model import (
    COMPREHENSIONS,
    Script,
    bound_arguments,
    children,
    keyword,
    own_nodes,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import NO_RANKS, RANK_VARIABLES, rank_branch_sides
from assistant.lint.registry import check
from assistant.lint.torchapi import COLLECTIVES, is_dist_call
from assistant.results import Finding

# The tensor (or tensor list) parameters of each collective, in positional order,
# that must match across ranks. gather/scatter lists matter on the root only.
TENSOR_PARAMETERS = {
    "all_reduce": ("tensor",),
    "broadcast": ("tensor",),
    "reduce": ("tensor",),
    "all_gather": ("tensor_list", "tensor"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "gather": ("tensor",),
    "scatter": ("tensor",),
    "reduce_scatter": ("output", "input_list"),
    "reduce_scatter_tensor": ("output", "input"),
}
# Factories whose every positional argument (and size=) is a dimension.
SIZE_FACTORIES = frozenset({"zeros", "ones", "empty", "rand", "randn", "arange"})
LIKE_FACTORIES = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like"})
NEW_FACTORIES = frozenset({"new_zeros", "new_ones", "new_empty", "new_full"})
DATA_FACTORIES = frozenset({"tensor", "as_tensor"})
# Methods that return a tensor of the same shape as their receiver.
SHAPE_KEEPING = frozenset(
    {
        "to",
        "type",
        "cuda",
        "cpu",
        "float",
        "half",
        "double",
        "bfloat16",
        "long",
        "int",
        "bool",
        "contiguous",
        "clone",
        "detach",
        "requires_grad_",
    }
)
DTYPES = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "half",
        "float",
        "double",
        "int8",
        "int16",
        "int32",
        "int64",
        "long",
        "int",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    }
)
# Names that hold this process's own rank (not a peer's: src_rank, shard_rank).
OWN_RANK_NAME = re.compile(
    r"^(rank|local_?rank|global_?rank|world_?rank|node_?rank|my_?rank|ddp_?rank|"
    r"proc(ess)?_?rank|l?rank_?(id|idx)|local_rank_id|lrank|grank)$",
    re.IGNORECASE,
)
# Methods whose arguments place a tensor or a module, or seed a generator.
PLACEMENT_METHODS = frozenset({"to", "cuda", "set_device", "manual_seed", "seed"})
# Expressions nested deeper than this are not followed (silence, not a guess).
MAX_FOLLOWED_DEPTH = 32


@dataclass(frozen=True)
class Taint:
    """Why a tensor or list differs between ranks: what differs, and where it was made."""

    what: str  # "shape", "dtype", "length", or "value" for a number or name
    made_by: ast.expr  # the expression that made it
    name: str | None = None  # the name it was assigned to, for a value
    branch: ast.If | None = None  # the rank test that chose it, for a value
    via: Taint | None = None  # the rank-dependent name it was made from (`n` of zeros(n))

    @property
    def line(self) -> int:
        return self.made_by.lineno

    @property
    def source(self) -> str:
        # Only for a message: unparse is not cheap.
        text = source_text(self.made_by)
        text = f"{self.name} = {text}" if self.name else text
        if self.branch is not None:
            text += f" under `if {source_text(self.branch.test)}`"
        return f"{text}, with {self.via.source}" if self.via is not None else text


@dataclass
class Flow:
    """What the names of one function hold so far, walking its statements in order."""

    script: Script
    rank_values: dict[str, Taint] = field(default_factory=dict)  # rank-dependent values
    tensors: dict[str, Taint] = field(default_factory=dict)  # rank-shaped tensors and lists
    # id of an assignment inside a branch only some ranks take -> that branch's `if`
    chosen_by_rank: dict[int, ast.If] = field(default_factory=dict)


@check("collective-mismatch", "uneven-inputs")
def check_collectives_that_depend_on_rank(script: Script) -> Iterator[Finding]:
    """A collective reached by every rank whose tensors' shape, dtype or count depends on the
    rank (collective-mismatch), or in a loop whose number of iterations does (uneven-inputs).

    One walk of the data flow serves both: each reads what the names hold at its event.
    """
    guarded = rank_guarded_calls(script)
    for flow, node in flow_walk(script):
        if isinstance(node, ast.Call):
            if id(node) not in guarded:
                yield from collective_finding(flow, node)
        elif isinstance(node, (ast.For, ast.While)):
            yield from loop_finding(flow, node, guarded)


def loop_finding(flow: Flow, loop: ast.For | ast.While, guarded: set[int]) -> Iterator[Finding]:
    """uneven-inputs for the first unguarded collective of a loop whose trip count depends on
    the rank, if it is one."""
    if isinstance(loop, ast.For):
        trips = trip_count_taint(flow, loop.iter)
        shown = f"per item of {source_text(loop.iter)}"
    elif depends_on_rank(flow, loop.test):
        trips = named_origin(flow, [loop.test]) or Taint("length", loop.test)
        shown = f"per pass of `while {source_text(loop.test)}`"
    else:
        return
    if trips is None:
        return
    script = flow.script
    collective = next((c for c in loop_collectives(script, loop) if id(c) not in guarded), None)
    if collective is None:
        return
    origin = f" ({trips.source}, line {trips.line})" if trips.source not in shown else ""
    yield script.finding(
        "uneven-inputs",
        collective,
        f"{short(script.name_of(collective.func))}() runs once {shown}, whose count "
        f"depends on the rank{origin}: ranks call it a different number of times, "
        "and the others hang",
    )


def rank_guarded_calls(script: Script) -> set[int]:
    """ids of calls that some trace reaches under a rank test (the reach check's business)."""
    return {id(call.node) for trace in script.traces for call in trace if call.rank_path}


def flow_walk(
    script: Script, scopes: list[ast.AST] | None = None
) -> Iterator[tuple[Flow, ast.AST]]:
    """Each scope's events in order (the module's and every function's, or `scopes`),
    with what its names hold just before each one."""
    for scope in [script.tree, *script.functions.values()] if scopes is None else scopes:
        flow = Flow(script)
        for node in ordered_events(script, scope):
            yield flow, node
            if isinstance(node, ast.Call):
                synced(flow, node)
            else:
                record(flow, node)


def trip_count_taint(flow: Flow, items: ast.expr) -> Taint | None:
    """Why `for _ in items` runs a rank-dependent number of times; None if it does not."""
    if is_range(flow.script, items) and depends_on_rank(flow, items):
        # `range(steps)`: where steps came from says more than range(steps) does.
        keys = (key_of(node) for node in walk(items))
        origin = next((flow.rank_values[k] for k in keys if k in flow.rank_values), None)
        if origin is not None:
            return Taint("length", origin.made_by, origin.name, origin.branch)
        return Taint("length", items)
    taint = list_taint(flow, items)
    return taint if taint is not None and taint.what == "length" else None


def loop_collectives(script: Script, loop: ast.For | ast.While) -> list[ast.Call]:
    """The torch.distributed collectives in a loop's body, in source order."""
    calls = [
        n
        for stmt in loop.body
        for n in own_nodes(stmt)
        if isinstance(n, ast.Call) and is_dist_call(script.name_of(n.func), COLLECTIVES)
    ]
    return sorted(calls, key=lambda n: (n.lineno, n.col_offset))


def ordered_events(script: Script, scope: ast.AST) -> list[ast.AST]:
    """Assignments, loops, `if`s and calls of a scope in the order they take effect.

    An assignment takes effect at its end (after the calls in its value);
    a loop at its start, where its target and the lists it appends to change
    (a `while` binds nothing; the uneven-inputs check reads its test there);
    an `if` at its start, where its branches' assignments become rank choices.
    """
    kinds = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.While, ast.If, ast.Call)
    events = [node for node in script.scope_nodes(scope) if isinstance(node, kinds)]

    def position(node: ast.AST) -> tuple[int, int]:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return (node.end_lineno or node.lineno, node.end_col_offset or 0)
        return (node.lineno, node.col_offset)

    return sorted(events, key=position)


def record(flow: Flow, node: ast.AST) -> None:
    """Update what names hold after an assignment or at the start of a loop."""
    if isinstance(node, ast.For):
        record_loop(flow, node)
        return
    if isinstance(node, ast.If):
        record_branches(flow, node)
        return
    if isinstance(node, ast.While):
        return  # its test is read where the loop is judged; it binds nothing
    value = node.value
    if value is None:  # `x: int` without a value
        return
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    branch = flow.chosen_by_rank.get(id(node))
    for target in targets:
        for each_target, each_value in assigned_pairs(target, value, flow.script):
            bind(flow, each_target, each_value, isinstance(node, ast.AugAssign), branch)


def record_branches(flow: Flow, test_if: ast.If) -> None:
    """`if rank == 0: n = 10 else: n = 5`: the literals assigned in either branch are rank choices.

    Not `if local_rank == -1:`, which every rank of a distributed run decides alike.
    """
    if not depends_on_rank(flow, test_if.test):
        return
    if NO_RANKS in rank_branch_sides(test_if.test, flow.script):
        return
    for stmt in [*test_if.body, *test_if.orelse]:
        for node in [stmt, *own_nodes(stmt)]:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                flow.chosen_by_rank.setdefault(id(node), test_if)


def assigned_pairs(
    target: ast.expr, value: ast.expr, script: Script | None = None
) -> list[tuple[ast.expr, ast.expr]]:
    """`rank, world = get_rank(), get_world_size()` pairs each name with its own value;
    `a, b = f(rank)` gives both names the whole value, but where `f` is a function
    of the file (`script`) that returns a tuple of that size: each name is paired
    with `f(rank)[i]`, its own element (depends_on_rank follows that one back)."""
    pairs: list[tuple[ast.expr, ast.expr]] = []
    pending = [(target, value)]
    while pending:
        each_target, each_value = pending.pop()
        if not isinstance(each_target, (ast.Tuple, ast.List)) or any(
            isinstance(e, ast.Starred) for e in each_target.elts
        ):
            pairs.extend((name, each_value) for name in unpacked(each_target))
        elif isinstance(each_value, (ast.Tuple, ast.List)) and len(each_target.elts) == len(
            each_value.elts
        ):
            pending.extend(zip(each_target.elts, each_value.elts, strict=True))
        elif (shape := shape_of(each_value)) is not None:
            # `b, d, h, w = e.shape`: each name its own dimension (reads_a_feature_size)
            pending.extend(
                (element, ast.copy_location(element_of(shape, position), each_value))
                for position, element in enumerate(each_target.elts)
            )
        elif script is not None and returns_tuples_of(script, each_value, len(each_target.elts)):
            pending.extend(
                (element, ast.copy_location(element_of(each_value, position), each_value))
                for position, element in enumerate(each_target.elts)
            )
        else:
            pairs.extend((name, each_value) for name in unpacked(each_target))
    return pairs


def shape_of(value: ast.expr) -> ast.Attribute | None:
    """`e.shape` of `e.shape` or `e.size()`, the tuple of e's dimensions."""
    if isinstance(value, ast.Attribute) and value.attr == "shape":
        return value
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "size"
        and not value.args
    ):
        return ast.Attribute(value=value.func.value, attr="shape", ctx=ast.Load())
    return None


def returns_tuples_of(script: Script, value: ast.expr, size: int) -> bool:
    """`value` calls a function of the file every `return` of which is a tuple of `size`."""
    function = called_function(script, value)
    return function is not None and tuple_size_returned(function) == size


def tuple_size_returned(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    """The size of the tuple every `return` of the function writes out, if they agree."""
    returned = [n.value for n in own_nodes(function) if isinstance(n, ast.Return)]
    sizes = {
        len(r.elts) if isinstance(r, ast.Tuple) and not has_starred(r) else None for r in returned
    }
    return sizes.pop() if len(sizes) == 1 else None


def called_function(
    script: Script, value: ast.expr
) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The file's own function `value` calls by name (`build_data(args, rank)`), if any,
    when it takes no *args."""
    function = script.function_called(value)
    return function if function is not None and function.args.vararg is None else None


def has_starred(value: ast.Tuple) -> bool:
    return any(isinstance(e, ast.Starred) for e in value.elts)


def element_of(call: ast.expr, position: int) -> ast.Subscript:
    return ast.Subscript(value=call, slice=ast.Constant(position), ctx=ast.Load())


def unpacked(target: ast.expr) -> list[ast.expr]:
    """The names a target binds: `a`, `a, (b, *c)`, `self.x`."""
    names: list[ast.expr] = []
    pending = [target]
    while pending:
        each = pending.pop()
        if isinstance(each, (ast.Tuple, ast.List)):
            pending.extend(each.elts)
        elif isinstance(each, ast.Starred):
            pending.append(each.value)
        else:
            names.append(each)
    return names


def bind(
    flow: Flow, target: ast.expr, value: ast.expr, augmented: bool, branch: ast.If | None
) -> None:
    """`target = value` (or `target += value`): what the name holds from now on.

    `branch` is the rank test whose branch the assignment is in, if any: a
    literal chosen there (`n = 5`) differs between ranks. Anything else
    chosen there (`t = torch.empty(n)` on the ranks that receive a broadcast)
    may well match what the other branch makes, so it is not a choice.
    """
    key = key_of(target)
    if key is None:
        return
    rank_valued = depends_on_rank(flow, value)
    choice = branch if branch is not None and is_literal(value) else None
    taint = tensor_taint(flow, value) or list_taint(flow, value)
    if not (augmented and key in flow.rank_values):  # `n += 1` keeps why n depends on it
        if rank_valued or choice is not None:
            flow.rank_values[key] = Taint("value", value, key, choice)
        else:
            flow.rank_values.pop(key, None)
    if augmented:  # `t += 1` keeps t's shape
        taint = flow.tensors.get(key) or taint
    if taint is not None:
        flow.tensors[key] = taint
    else:
        flow.tensors.pop(key, None)


def is_literal(value: ast.expr) -> bool:
    """`5`, `-1`, `(10, 4)`, `"nccl"`: a value written out in the source."""
    allowed = (ast.Constant, ast.UnaryOp, ast.Tuple, ast.List, ast.unaryop, ast.expr_context)
    return all(isinstance(node, allowed) for node in walk(value))


def record_loop(flow: Flow, loop: ast.For) -> None:
    """`for i in range(rank): xs.append(...)`: i is rank-dependent, and so is len(xs)."""
    if not depends_on_rank(flow, loop.iter):
        return
    for target in unpacked(loop.target):
        key = key_of(target)
        if key is not None:
            flow.rank_values[key] = Taint("value", loop.iter, key)
    if not is_range(flow.script, loop.iter):
        return  # `for x in data[rank::world]`: a shard, not a count
    for node in (n for stmt in loop.body for n in own_nodes(stmt)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "insert")
        ):
            key = key_of(node.func.value)
            if key is not None:
                flow.tensors[key] = Taint("length", loop.iter)


def collective_finding(flow: Flow, node: ast.Call) -> Iterator[Finding]:
    """The finding for a collective with a rank-dependent tensor, if it is one."""
    name = flow.script.name_of(node.func)
    if not is_dist_call(name, COLLECTIVES):
        return
    collective = short(name)
    for argument in tensor_arguments(node, collective):
        taint = tensor_taint(flow, argument) or list_taint(flow, argument)
        if taint is not None:
            yield flow.script.finding(
                "collective-mismatch", node, message(collective, argument, taint)
            )
            return


def synced(flow: Flow, node: ast.Call) -> None:
    """After a collective its tensors hold the same values on every rank
    (`dist.all_reduce(size, op=MAX)`): sizes read from them no longer differ."""
    if not is_dist_call(flow.script.name_of(node.func), COLLECTIVES):
        return
    for argument in [*node.args, *(k.value for k in node.keywords)]:
        key = key_of(argument)
        if key is not None:
            flow.rank_values.pop(key, None)


def tensor_arguments(node: ast.Call, collective: str) -> list[ast.expr]:
    """The tensors (and tensor lists) of a collective call that must match across ranks."""
    parameters = TENSOR_PARAMETERS.get(collective, ())
    found = list(node.args[: len(parameters)])
    found += [k.value for k in node.keywords if k.arg in parameters]
    return found


def message(collective: str, argument: ast.expr, taint: Taint) -> str:
    shown, made = source_text(argument), taint.source
    if taint.what == "length":
        what = f"the length of {shown}"
    else:
        what = f"the {taint.what} of {shown}" if shown != made else f"its {taint.what}"
    return (
        f"{collective}() is called by every rank, but {what} depends on the rank "
        f"({made}, line {taint.line}): "
        "every rank must pass the same shapes and dtypes, or it hangs or fails"
    )


# ---------------------------------------------------------------- what depends on the rank


def key_of(expr: ast.expr) -> str | None:
    """`t` or `self.buffer`: a name the flow can follow; None for anything else."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def depends_on_rank(flow: Flow, expr: ast.expr) -> bool:
    """The value of `expr` may differ between ranks (strings and devices aside)."""
    stack: list[ast.AST] = [expr]
    # a comprehension's own variables: `c` of `max(c.item() for c in counts)` holds
    # the items of counts, not the file's other `c`; what they hold is judged by the
    # iterable, which is walked
    bound: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in bound:
            continue
        if isinstance(node, COMPREHENSIONS):
            names = {
                n.id for g in node.generators for n in walk(g.target) if isinstance(n, ast.Name)
            }
            bound.update(
                id(n)
                for n in walk(node)
                if isinstance(n, ast.Name) and n.id in names and n is not node
            )
        if isinstance(node, (ast.JoinedStr, ast.Lambda, ast.keyword, ast.Slice)):
            # f"cuda:{rank}" or a log line is text, never a size; a keyword
            # (DistributedSampler(rank=rank), device=rank) configures an object;
            # data[rank::world_size] is each rank's shard, of (nearly) equal size.
            continue
        if is_own_rank(flow.script, node):
            return True
        if reads_a_feature_size(node):
            continue
        element = returned_element(flow.script, node)
        if element is not None:
            stack.extend(element)
            continue
        if isinstance(node, ast.Call):
            own = own_method_call(flow, node)
            if own is not None:
                # `start = backup.on_train_begin()`: what the method returns, not
                # everything the object was built with (a rank kept for printing)
                stack.extend(own)
                continue
            # The receiver and the arguments, not the method's name (`placement.rank()`);
            # of `batch.to(rank)` the receiver only: the rank there is a device.
            if isinstance(node.func, ast.Attribute):
                stack.append(node.func.value)
            if not is_placement(flow.script, node):
                stack.extend(arguments_returned(flow.script, node))
            continue
        if isinstance(node, ast.Constant) and node.value in RANK_VARIABLES:
            return True  # os.environ["RANK"]
        if isinstance(node, (ast.Name, ast.Attribute)):
            key = key_of(node)
            if key in flow.rank_values or key in flow.tensors:
                return True  # `n` from `n = rank + 1`; `t.numel()` of a rank-shaped t
        if isinstance(node, ast.Attribute) and (field := own_field_read(flow, node)) is not None:
            # `trainer.step` of `trainer = Trainer(args, rank, ...)`: what the class
            # assigns to that field, not everything the object was built with
            values, parameters = field
            bound.update(parameters)
            stack.extend(values)
            continue
        stack.extend(children(node))
    return False


def own_method_call(flow: Flow, call: ast.Call) -> list[ast.expr] | None:
    """For `obj.method(...)` where `obj` was built here as `Cls(...)`, a class of the
    file that defines `method`: the expressions whose values can reach what it
    returns (its arguments bound to parameters it returns, and the constructor's
    arguments behind the fields `self.x` it returns); None for any other call."""
    if not (isinstance(call.func, ast.Attribute) and (key := key_of(call.func.value))):
        return None
    taint = flow.rank_values.get(key)
    built = taint.made_by if taint is not None else None
    if not (isinstance(built, ast.Call) and isinstance(built.func, ast.Name)):
        return None
    method = flow.script.functions.get(f"{built.func.id}.{call.func.attr}")
    init = flow.script.functions.get(f"{built.func.id}.__init__")
    if method is None or init is None or method.args.vararg is not None:
        return None
    returned = parameters_returned(method)
    reached = [
        argument
        for parameter, argument in bound_arguments(method, call, self_bound=True)
        if parameter is None or parameter in returned
    ]
    fields = fields_returned(method)
    sources = {
        name.id
        for node in walk(init)
        if isinstance(node, ast.Assign)
        for target, value in target_value_pairs(node)
        if key_of(target) in {f"self.{f}" for f in fields}
        for name in walk(value)
        if isinstance(name, ast.Name)
    }
    reached += [
        argument
        for parameter, argument in bound_arguments(init, built, self_bound=True)
        if parameter is None or parameter in sources
    ]
    return reached


def own_field_read(flow: Flow, read: ast.Attribute) -> tuple[list[ast.expr], set[int]] | None:
    """For `obj.field` where `obj` was built here as `Cls(...)`, a class of the file
    whose methods assign `self.field`: the values they assign it and the
    constructor's arguments bound to the parameters those values read, with the ids
    of the parameter names in them (their values are the arguments); None for any
    other read, or a field the class never assigns."""
    key = key_of(read.value)
    taint = flow.rank_values.get(key) if key else None
    built = taint.made_by if taint is not None else None
    if not (isinstance(built, ast.Call) and isinstance(built.func, ast.Name)):
        return None
    cls = next((c for c in flow.script.of_type(ast.ClassDef) if c.name == built.func.id), None)
    init = flow.script.functions.get(f"{built.func.id}.__init__")
    if cls is None or init is None:
        return None
    assigned = values_of_fields(cls)
    values: list[ast.expr] = []
    parameters: set[int] = set()
    pending, seen = [read.attr], set()
    while pending:  # `self.step = self.start`: the fields a field is made from, too
        field = pending.pop()
        if field in seen:
            continue
        seen.add(field)
        for value, own in assigned.get(field, []):
            values.append(value)
            for n in walk(value):
                if isinstance(n, ast.Name) and n.id in own:
                    parameters.add(id(n))
                elif isinstance(n, ast.Attribute) and key_of(n) == f"self.{n.attr}":
                    pending.append(n.attr)
    if not values:
        return None
    read_names = {
        n.id
        for value in values
        for n in walk(value)
        if isinstance(n, ast.Name) and id(n) in parameters
    }
    values += [
        argument
        for parameter, argument in bound_arguments(init, built, self_bound=True)
        if parameter is None or parameter in read_names
    ]
    return values, parameters


def values_of_fields(cls: ast.ClassDef) -> dict[str, list[tuple[ast.expr, set[str]]]]:
    """Field -> (value, the parameter names of the method that assigns it) for each
    `self.field = value` (or `+=`) in the class's methods."""
    found: dict[str, list[tuple[ast.expr, set[str]]]] = {}
    for method in (m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)):
        own = {
            a.arg for a in [*method.args.posonlyargs, *method.args.args, *method.args.kwonlyargs]
        }
        for node in walk(method):
            if isinstance(node, ast.Assign):
                pairs = target_value_pairs(node)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
                pairs = [(node.target, node.value)]
            else:
                continue
            for target, value in pairs:
                key = key_of(target)
                if key is not None and key.startswith("self.") and key.count(".") == 1:
                    found.setdefault(key[5:], []).append((value, own))
    return found


def target_value_pairs(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of each target of an assignment, fields too: `self.a, self.b =
    a, b` pairs them one by one; a tuple unpacked from one value pairs each with it."""
    pairs: list[tuple[ast.expr, ast.expr]] = []
    for target in node.targets:
        if not isinstance(target, ast.Tuple):
            pairs.append((target, node.value))
        elif isinstance(node.value, ast.Tuple) and len(node.value.elts) == len(target.elts):
            pairs += zip(target.elts, node.value.elts, strict=True)
        else:
            pairs += [(element, node.value) for element in target.elts]
    return pairs


def fields_returned(method: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The fields `self.x` read by what reaches a return of the method."""
    names = parameters_returned(method) | {"self"}
    values = [n.value for n in walk(method) if isinstance(n, ast.Return) and n.value]
    values += [
        node.value
        for node in walk(method)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id in names for t in node.targets)
    ]
    return {
        node.attr
        for value in values
        for node in walk(value)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def arguments_returned(script: Script, call: ast.Call) -> list[ast.expr]:
    """The positional arguments whose value can reach what the call returns: all of
    them, except for a function of this file, whose returns are followed back to
    its parameters (`load_checkpoint(model, opt, rank)` that reads a per-rank
    shard but returns the step every rank shares)."""
    function = script.function_called(call)
    if function is None or function.args.vararg is not None:
        return list(call.args)
    returned = parameters_returned(function)
    positional = {id(argument) for argument in call.args}  # keywords configure (see above)
    return [
        argument
        for parameter, argument in bound_arguments(function, call)
        if id(argument) in positional and (parameter is None or parameter in returned)
    ]


def returned_element(script: Script, node: ast.AST) -> list[ast.expr] | None:
    """For `f(a, b)[i]`, `f` a function of the file returning tuples: the arguments
    whose value can reach element i of what it returns (`loader = build(args,
    rank)[1]` where only the validation loader, element 2, is cut by the rank)."""
    if not (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and type(node.slice.value) is int
        and node.slice.value >= 0
    ):
        return None
    call = node.value
    function = called_function(script, call)
    if not isinstance(call, ast.Call) or function is None:
        return None
    size = tuple_size_returned(function)
    if size is None or node.slice.value >= size:
        return None
    returned = parameters_returned(function, node.slice.value)
    positional = {id(argument) for argument in call.args}
    return [
        argument
        for parameter, argument in bound_arguments(function, call)
        if id(argument) in positional and (parameter is None or parameter in returned)
    ]


def parameters_returned(
    function: ast.FunctionDef | ast.AsyncFunctionDef, position: int | None = None
) -> set[str]:
    """Names whose value can reach a `return` of `function` (or element `position`
    of the tuples it returns), followed back through its assignments, loop and
    with targets (a name reached is all of its values)."""
    sources: dict[str, list[ast.AST]] = {}
    for node in walk(function):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in (n.id for n in walk(target) if isinstance(n, ast.Name)):
                    sources.setdefault(name, []).append(node.value)
        elif isinstance(node, ast.For):
            for name in (n.id for n in walk(node.target) if isinstance(n, ast.Name)):
                sources.setdefault(name, []).append(node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            for name in (n.id for n in walk(node.optional_vars) if isinstance(n, ast.Name)):
                sources.setdefault(name, []).append(node.context_expr)
    # What a collective wrote (the buffers all_gather filled) is every rank's alike:
    # its values before the collective do not reach the return.
    collected = received_buffers(function)
    reached: set[str] = set()
    # the function's own returns (a nested function's `return a, b` is not one of them)
    pending = [n.value for n in own_nodes(function) if isinstance(n, ast.Return) and n.value]
    if position is not None:
        pending = [
            r.elts[position] for r in pending if isinstance(r, ast.Tuple) and position < len(r.elts)
        ]
    while pending:
        for node in walk(pending.pop()):
            if isinstance(node, ast.Name) and node.id not in reached:
                reached.add(node.id)
                if node.id not in collected:
                    pending.extend(sources.get(node.id, []))
    return reached - collected


# Collectives that fill their first argument with what every rank sent.
GATHERING = frozenset({"all_gather", "all_gather_object", "all_gather_into_tensor"})


def received_buffers(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names a gathering collective in the function fills (`dist.all_gather(out, x)`: out)."""
    return {
        node.args[0].id
        for node in walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in GATHERING
        and node.args
        and isinstance(node.args[0], ast.Name)
    }


def reads_a_feature_size(node: ast.AST) -> bool:
    """`t.shape[1]`, `t.shape[1:]`, `t.size(2)`: a size past the first dimension.

    What a rank's data changes is how many rows it has (samples, items,
    detections); the feature sizes a buffer copies from a tensor are the
    model's, the same on every rank (`torch.empty(n, local.shape[1])`).
    """
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
        if node.value.attr != "shape":
            return False
        index = node.slice.lower if isinstance(node.slice, ast.Slice) else node.slice
        return isinstance(index, ast.Constant) and isinstance(index.value, int) and index.value >= 1
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr != "size" or len(node.args) != 1:
            return False
        index = node.args[0]
        return isinstance(index, ast.Constant) and isinstance(index.value, int) and index.value >= 1
    return False


def is_own_rank(script: Script, node: ast.AST) -> bool:
    """This process's rank: `rank`, `args.local_rank`, `self.global_rank`, `dist.get_rank()`.

    Narrower than the names an `if` tests: `shard_rank`, `src_rank` or
    `dst_rank` name some process, the same one on every rank.
    """
    if isinstance(node, ast.Call):
        return short(script.name_of(node.func)) in ("get_rank", "get_local_rank")
    if isinstance(node, ast.Name):
        return bool(OWN_RANK_NAME.match(node.id))
    if isinstance(node, ast.Attribute):
        return bool(OWN_RANK_NAME.match(node.attr))
    return False


def is_placement(script: Script, call: ast.Call) -> bool:
    """A call whose arguments place or seed, never size: .to(rank), torch.device(...), seeds."""
    if isinstance(call.func, ast.Attribute) and call.func.attr in PLACEMENT_METHODS:
        return True
    return short(script.name_of(call.func)) in ("device", "manual_seed", "seed")


def tensor_taint(flow: Flow, expr: ast.expr, depth: int = 0) -> Taint | None:
    """Why the tensor `expr` has a rank-dependent shape or dtype; None if it does not."""
    if depth > MAX_FOLLOWED_DEPTH:
        return None
    key = key_of(expr)
    if key is not None:
        return flow.tensors.get(key)
    if isinstance(expr, ast.BinOp):
        return tensor_taint(flow, expr.left, depth + 1) or tensor_taint(flow, expr.right, depth + 1)
    if isinstance(expr, ast.IfExp):
        return (
            tensor_taint(flow, expr.body, depth + 1)
            or tensor_taint(flow, expr.orelse, depth + 1)
            or chosen_by_rank(flow, expr)
        )
    if isinstance(expr, ast.Call):
        return call_taint(flow, expr, depth)
    return None


def call_taint(flow: Flow, call: ast.Call, depth: int) -> Taint | None:
    """A factory given a rank-dependent size or dtype, or a method that keeps such a shape."""
    name = flow.script.name_of(call.func)
    factory = short(name) if name.startswith("torch.") and name.count(".") == 1 else ""
    sizes: list[ast.expr] = []
    if factory == "arange":
        sizes = arange_lengths(flow, call)
    elif factory in SIZE_FACTORIES:
        sizes = [*call.args, *filter(None, [keyword(call, "size")])]
    elif factory == "full":
        sizes = [*call.args[:1], *filter(None, [keyword(call, "size")])]
    elif factory == "randint":
        sizes = [a for a in call.args if isinstance(a, (ast.Tuple, ast.List))]
        sizes += list(filter(None, [keyword(call, "size")]))
    elif factory in DATA_FACTORIES and call.args:
        taint = list_taint(flow, call.args[0], depth + 1)
        if taint is not None and taint.what == "length":
            return Taint("shape", taint.made_by)
    elif factory in LIKE_FACTORIES and call.args:
        taint = tensor_taint(flow, call.args[0], depth + 1)
        if taint is not None:
            return taint
    elif isinstance(call.func, ast.Attribute) and call.func.attr in NEW_FACTORIES:
        sizes = call.args[:1] if call.func.attr == "new_full" else list(call.args)
    elif isinstance(call.func, ast.Attribute) and call.func.attr in SHAPE_KEEPING:
        kept = tensor_taint(flow, call.func.value, depth + 1)
        if kept is not None:
            return kept
        dtypes = [*call.args, *filter(None, [keyword(call, "dtype")])]
        if any(is_rank_dtype(flow, d) for d in dtypes):
            return Taint("dtype", call)
        return None
    if any(depends_on_rank(flow, size) for size in sizes):
        return Taint("shape", call, via=named_origin(flow, sizes))
    dtype = keyword(call, "dtype")
    if factory and dtype is not None and is_rank_dtype(flow, dtype):
        return Taint("dtype", call)
    return None


def arange_lengths(flow: Flow, call: ast.Call) -> list[ast.expr]:
    """The arguments of torch.arange that set its length.

    `arange(rank * n, (rank + 1) * n)` has n elements on every rank: when both
    ends move with the rank, only the step can change the length.
    """
    args = list(call.args)
    if len(args) >= 2 and depends_on_rank(flow, args[0]) and depends_on_rank(flow, args[1]):
        return args[2:]
    return args


def named_origin(flow: Flow, exprs: list[ast.expr]) -> Taint | None:
    """Where the first rank-dependent name among `exprs` got its value (`rows = 2 * rank`)."""
    for expr in exprs:
        for node in walk(expr):
            if is_own_rank(flow.script, node):
                return None  # `rank` needs no explanation
            origin = flow.rank_values.get(key_of(node) or "")
            if origin is not None:
                return origin
    return None


def is_rank_dtype(flow: Flow, expr: ast.expr) -> bool:
    """`torch.half if rank == 0 else torch.float`: a dtype chosen by the rank."""
    names_dtype = any(
        isinstance(n, ast.Attribute)
        and n.attr in DTYPES
        and flow.script.name_of(n).startswith("torch.")
        for n in walk(expr)
    )
    return names_dtype and depends_on_rank(flow, expr)


def chosen_by_rank(flow: Flow, choice: ast.IfExp) -> Taint | None:
    """`torch.zeros(10) if rank == 0 else torch.zeros(5)`: two literal shapes, picked by rank."""
    if not depends_on_rank(flow, choice.test):
        return None
    sides = [choice.body, choice.orelse]
    if not all(isinstance(s, ast.Call) and literal_factory(flow, s) for s in sides):
        return None
    if source_text(choice.body) == source_text(choice.orelse):
        return None
    return Taint("shape", choice)


def literal_factory(flow: Flow, call: ast.Call) -> bool:
    """A torch size factory whose arguments are all literals (`torch.zeros(10, 4)`)."""
    name = flow.script.name_of(call.func)
    return (
        name.startswith("torch.")
        and short(name) in SIZE_FACTORIES
        and all(isinstance(a, ast.Constant) for a in call.args)
    )


def list_taint(flow: Flow, expr: ast.expr, depth: int = 0) -> Taint | None:
    """Why the list `expr` has a rank-dependent length or holds rank-shaped tensors."""
    if depth > MAX_FOLLOWED_DEPTH:
        return None
    key = key_of(expr)
    if key is not None:
        return flow.tensors.get(key)
    if isinstance(expr, (ast.ListComp, ast.GeneratorExp)):
        for generator in expr.generators:
            if is_range(flow.script, generator.iter) and depends_on_rank(flow, generator.iter):
                return Taint("length", expr)
        return tensor_taint(flow, expr.elt, depth + 1)
    if isinstance(expr, (ast.List, ast.Tuple)):
        return next(filter(None, (tensor_taint(flow, e, depth + 1) for e in expr.elts)), None)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
        for items, count in ((expr.left, expr.right), (expr.right, expr.left)):
            if isinstance(items, (ast.List, ast.ListComp)) and depends_on_rank(flow, count):
                return Taint("length", expr)
        return list_taint(flow, expr.left, depth + 1) or list_taint(flow, expr.right, depth + 1)
    if isinstance(expr, ast.Call) and flow.script.name_of(expr.func) in ("list", "tuple"):
        return list_taint(flow, expr.args[0], depth + 1) if expr.args else None
    return None


def is_range(script: Script, expr: ast.expr) -> bool:
    return isinstance(expr, ast.Call) and script.name_of(expr.func) == "range"
