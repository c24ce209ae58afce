"""A collective over one entry per key that this rank's own data produced.

    per_class = defaultdict(lambda: [0, 0])
    for t, p in zip(labels.tolist(), preds.tolist()):
        per_class[t][0] += int(t == p)
    counts = torch.tensor([per_class[c] for c in sorted(per_class)])
    dist.all_reduce(counts)

The dict's keys are the classes (speakers, domains, languages ...) that this
rank's share of the data happened to hold. A rare class missing from one
rank's share makes its tensor shorter: gloo closes the connection, NCCL hangs
or reads past the end, and where the lengths agree the rows pair different
classes, so the sums are silently wrong (collective-mismatch). Equal sample
counts (a DistributedSampler) do not help: the samples differ. The fix: one
row per class of the whole label set (`torch.zeros(num_classes, 2)` indexed
by the class), or `all_gather_object` of the dict and a merge.

Read within one function: a dict, Counter or set made empty (or a Counter
of the data), filled with keys that a loop over non-constant data binds;
the collective's tensor, followed back through its names, holds a walk over
that container's keys (`sorted(d)`, `d.values()`, a comprehension over it)
or is sized by their count (`torch.zeros(len(d))`); a collective in a loop
over those keys is called a different number of times on each rank. Quiet
where the count or a sum of the container is the value sent (`len(d)` in a
list, `sum(d.values())`), and where the keys were exchanged first (an
object collective in the function).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.gather_sizes import is_loader, origin, scope_values, walk_until
from assistant.lint.model import Script, called_name, short, source_text, walk
from assistant.lint.registry import check
from assistant.lint.torchapi import is_dist_call, runs_a_process_per_gpu
from assistant.results import Finding

CAUSE = "collective-mismatch"
# Collectives whose tensors must have one shape on every rank, and the position
# of the tensor each rank contributes.
SHAPED_COLLECTIVES = {
    "all_reduce": 0,
    "reduce": 0,
    "broadcast": 0,
    "all_gather": 1,
    "all_gather_into_tensor": 1,
    "reduce_scatter_tensor": 1,
}
SHAPED_NAMES = frozenset(SHAPED_COLLECTIVES)
# Collectives that exchange Python objects: the keys agree after one of them.
OBJECT_COLLECTIVES = frozenset(
    {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}
)
EMPTY_MAPPINGS = frozenset({"defaultdict", "dict", "Counter", "OrderedDict", "set"})
FILLING_METHODS = frozenset({"add", "setdefault", "update"})
KEY_WALKS = frozenset({"keys", "values", "items"})
WHOLE_WALKS = frozenset({"sorted", "list", "tuple", "enumerate", "zip", "reversed"})
# Calls that turn the keys into one number: what they send is the same shape everywhere.
SCALAR_CALLS = frozenset({"len", "sum", "max", "min", "any", "all", "mean"})
SIZE_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "rand", "randn"})
# A tensor's values read out for a Python loop: `for t in labels.tolist()`.
DATA_READS = frozenset({"tolist", "numpy", "cpu", "unique"})


@check(CAUSE)
def check_collective_over_the_keys_a_rank_saw(script: Script) -> Iterator[Finding]:
    """all_reduce of a tensor with one row per key the rank's data filled in."""
    if not runs_a_process_per_gpu(script):
        return
    for scope in script.all_scopes:
        nodes = script.scope_nodes(scope)
        if any(is_object_collective(script, node) for node in nodes):
            continue
        values = scope_values(nodes)
        seen = seen_key_containers(nodes, values)
        if not seen:
            continue
        reported: set[int] = set()  # a call in a loop over the keys: once, for the loop
        for node in nodes:
            if isinstance(node, ast.For) and walks_keys(node.iter, values, seen):
                for finding in loop_findings(script, node, values, seen):
                    reported.add(finding.line)
                    yield finding
            elif isinstance(node, ast.Call) and node.lineno not in reported:
                yield from tensor_finding(script, values, seen, node)


def is_object_collective(script: Script, node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and is_dist_call(
        script.name_of(node.func), OBJECT_COLLECTIVES
    )


def shaped_collective(script: Script, node: ast.Call) -> str | None:
    name = script.name_of(node.func)
    if not is_dist_call(name, SHAPED_NAMES):
        return None
    return short(name)


def tensor_finding(
    script: Script, values: dict[str, list[ast.expr]], seen: set[str], call: ast.Call
) -> Iterator[Finding]:
    collective = shaped_collective(script, call)
    if collective is None or len(call.args) <= SHAPED_COLLECTIVES[collective]:
        return
    tensor = call.args[SHAPED_COLLECTIVES[collective]]
    container = keyed_rows(tensor, values, seen)
    if container is None:
        return
    yield script.finding(
        CAUSE,
        call,
        f"{collective}({source_text(tensor)}): its rows are the keys of `{container}`, which "
        f"this rank's own data filled in, so a key missing on one rank makes its tensor "
        "shorter (error or hang) and otherwise pairs different keys' rows (wrong sums); "
        "reduce a tensor with one row per key of the whole set (e.g. "
        "`torch.zeros(num_classes, ...)` indexed by the class) or all_gather_object the dict",
    )


def loop_findings(
    script: Script, loop: ast.For, values: dict[str, list[ast.expr]], seen: set[str]
) -> Iterator[Finding]:
    container = walked_container(loop.iter, values, seen)
    for node in (n for statement in loop.body for n in walk(statement)):
        if isinstance(node, ast.Call) and shaped_collective(script, node):
            yield script.finding(
                CAUSE,
                node,
                f"{short(script.name_of(node.func))} once per key of `{container}` (line "
                f"{loop.lineno}), whose keys this rank's own data filled in: ranks that saw "
                "other keys call it a different number of times, or pair different keys "
                "(hang or wrong sums); loop over the whole key set (range(num_classes)) or "
                "all_gather_object the dict",
            )
            return


def seen_key_containers(nodes: list[ast.AST], values: dict[str, list[ast.expr]]) -> set[str]:
    """Names of dicts / Counters / sets made empty here and filled with keys that a
    loop over data binds (or a Counter made straight from the data)."""
    made_empty = {
        name
        for name, made in values.items()
        if made and all(is_empty_container(value) for value in made[:1])
    }
    statement_names, data_names = data_loop_names(nodes, values)
    filled: set[str] = set()
    for node in nodes:
        for base, key in filled_keys(node):
            if base in made_empty and names_in(key) & statement_names:
                filled.add(base)
    counted = {
        name
        for name, made in values.items()
        if any(is_counter_of_data(value, values, data_names) for value in made[:1])
    }
    return filled | counted


def is_empty_container(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict) and not value.keys:
        return True
    return (
        isinstance(value, ast.Call)
        and called_name(value) in EMPTY_MAPPINGS
        and (called_name(value) == "defaultdict" or not value.args)
    )


def is_counter_of_data(
    value: ast.expr, values: dict[str, list[ast.expr]], data_names: set[str]
) -> bool:
    """`Counter(labels.tolist())`: as many keys as distinct values this rank holds."""
    return (
        isinstance(value, ast.Call)
        and called_name(value) == "Counter"
        and bool(value.args)
        and walks_data(value.args[0], values, data_names)
    )


def data_loop_names(
    nodes: list[ast.AST], values: dict[str, list[ast.expr]]
) -> tuple[set[str], set[str]]:
    """Names a loop binds while walking this rank's data: a loader's batches, and
    what a loop over a batch's values (`y.tolist()`, a tensor read off a batch)
    binds; not a config's keys or range(10). (The function's own: for-loop names and
    names made of them; and those with what comprehensions bind, which are the
    comprehension's own: `{f"train/{n}": v for n, v in zip(names, agg.tolist())}`
    makes no `n` of the loop that fills `stats[n]`.)"""
    names = bound_while_walking([n for n in nodes if isinstance(n, ast.For)], values, set())
    # a key made from a loop name: `label = int(t)`
    names |= {name for name, made in values.items() if any(names_in(v) & names for v in made)}
    comprehensions = [n for n in nodes if isinstance(n, ast.comprehension)]
    return names, names | bound_while_walking(comprehensions, values, names)


def bound_while_walking(
    loops: list[ast.For] | list[ast.comprehension],
    values: dict[str, list[ast.expr]],
    known: set[str],
) -> set[str]:
    """The names `loops` bind that walk data, a loop inside a loop over it too."""
    names: set[str] = set()
    grew = True
    while grew:  # a loop over a batch's field, inside a loop over the loader
        grew = False
        for loop in loops:
            bound = names_in(loop.target)
            if bound <= names or not walks_data(loop.iter, values, names | known):
                continue
            names |= bound
            grew = True
    return names


def walks_data(expr: ast.expr, values: dict[str, list[ast.expr]], data: set[str]) -> bool:
    """A loader, a tensor's values (`.tolist()`), or something made of names bound
    from the data. A dict the scope made empty and filled by key is walked for its
    keys (`for t in loaders:`, a dict of one loader per task), not its data."""
    if isinstance(expr, ast.Name) and any(
        isinstance(value, ast.Dict) and is_empty_container(value)
        for value in values.get(expr.id, [])[:1]
    ):
        return False
    if is_loader(values, expr):
        return True
    for node in walk(expr):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in DATA_READS
        ):
            return True
        if isinstance(node, ast.Name) and node.id in data:
            return True
    return False


def filled_keys(node: ast.AST) -> Iterator[tuple[str, ast.expr]]:
    """(container, key) for `d[k] = ...`, `d[k][0] += 1`, `d.add(k)`, `d.setdefault(k, ..)`."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    for target in targets:
        subscript = outermost_key(target)
        if subscript is not None:
            yield subscript
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FILLING_METHODS
        and isinstance(node.func.value, ast.Name)
        and node.args
    ):
        yield node.func.value.id, node.args[0]


def outermost_key(target: ast.expr) -> tuple[str, ast.expr] | None:
    """`d[k][0]` -> ("d", k): the first subscript on the container's name."""
    while isinstance(target, ast.Subscript):
        if isinstance(target.value, ast.Name):
            return target.value.id, target.slice
        target = target.value
    return None


def names_in(expr: ast.AST) -> set[str]:
    return {n.id for n in walk(expr) if isinstance(n, ast.Name)}


def is_scalar_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and called_name(node) in SCALAR_CALLS


def keyed_rows(tensor: ast.expr, values: dict[str, list[ast.expr]], seen: set[str]) -> str | None:
    """The container whose keys give the tensor its rows, if any."""
    for value in origin(values, tensor, is_scalar_call):
        # `meter[k]` reads one entry by its key: no walk over the keys (`[meter[k] for
        # k in loss_fields]` has one row per field of a fixed list on every rank)
        read_by_key = {id(n.value) for n in walk(value) if isinstance(n, ast.Subscript)}
        for node in walk_until(value, is_scalar_call):
            if id(node) in read_by_key:
                continue
            container = walked_container(node, values, seen) or sized_by_keys(node, seen)
            if container:
                return container
    return None


def walks_keys(expr: ast.expr, values: dict[str, list[ast.expr]], seen: set[str]) -> bool:
    return walked_container(expr, values, seen) is not None


def walked_container(
    expr: ast.AST, values: dict[str, list[ast.expr]], seen: set[str]
) -> str | None:
    """`d`, `sorted(d)`, `d.values()`, a comprehension over one of them, or a name
    bound to one: the container walked."""
    if isinstance(expr, ast.comprehension | ast.For):
        return walked_container(expr.iter, values, seen)
    if isinstance(expr, ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp):
        return next(
            (c for g in expr.generators if (c := walked_container(g.iter, values, seen))), None
        )
    if isinstance(expr, ast.Name):
        if expr.id in seen:
            return expr.id
        return next(
            (
                c
                for v in values.get(expr.id, [])
                if not isinstance(v, ast.Name) or v.id != expr.id
                if (c := direct_walk(v, seen))
            ),
            None,
        )
    return direct_walk(expr, seen)


def direct_walk(expr: ast.AST, seen: set[str]) -> str | None:
    if isinstance(expr, ast.Name) and expr.id in seen:
        return expr.id
    if not isinstance(expr, ast.Call):
        return None
    func = expr.func
    if isinstance(func, ast.Attribute) and func.attr in KEY_WALKS:
        inner = func.value
        return inner.id if isinstance(inner, ast.Name) and inner.id in seen else None
    if called_name(expr) in WHOLE_WALKS:
        return next((c for a in expr.args if (c := direct_walk(a, seen))), None)
    return None


def sized_by_keys(node: ast.AST, seen: set[str]) -> str | None:
    """`torch.zeros(len(d), 2)`: a tensor with as many rows as the rank saw keys."""
    if not (isinstance(node, ast.Call) and called_name(node) in SIZE_FACTORIES):
        return None
    for argument in node.args:
        for inner in walk(argument):
            if (
                isinstance(inner, ast.Call)
                and called_name(inner) == "len"
                and inner.args
                and isinstance(inner.args[0], ast.Name)
                and inner.args[0].id in seen
            ):
                return inner.args[0].id
    return None
