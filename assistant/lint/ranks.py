"""Which ranks run a branch: `if rank == 0:`, `local_rank in [-1, 0]`, `is_main_process()`.

`rank_branch_sides(test)` says who runs the body and who the else branch of
`if test:` in a distributed run: rank 0 only, every rank but 0, no rank at
all (`if local_rank == -1:` is the single-process path), or None when any
rank may. The tracer records these branches around every call (a `RankPath`),
and the checks read them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from assistant.lint.model import (
    Function,
    Script,
    called_name,
    is_int,
    is_none,
    name_value_pairs,
    parameter_names,
    short,
    source_text,
    walk,
)
from assistant.lint.torchapi import MAIN_PROCESS_HELPERS

# Names that hold a rank: rank, local_rank, args.rank_id; not num_ranks or rank_zero.
RANK_NAME = re.compile(r"rank(_?id|_?idx)?$", re.IGNORECASE)
# The GPU index a spawned worker is given (`args.gpu`, `self.gpu_id`), which is its
# local rank: read as one only where it is compared (`if self.gpu_id == 0:`).
GPU_INDEX_NAME = re.compile(r"^gpu(_?id|_?idx)?$", re.IGNORECASE)
# Flags a script sets when it runs distributed: `args.distributed`, `ddp`.
DISTRIBUTED_FLAG = re.compile(
    r"^(is_|use_|multiprocessing_)?(distributed|ddp|dist)$|^(is_|use_)?multi_?gpu$", re.IGNORECASE
)
# What `rank % <this>` divides by when it asks for the first rank of a node.
PER_NODE = re.compile(r"gpus|gpu_count|per_node|nproc|local_world_size|device_count", re.IGNORECASE)
# Environment variables that hold the rank (launchers and schedulers).
RANK_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMI_RANK",
    }
)
RANK_ZERO, OTHER_RANKS, NO_RANKS = "rank 0 only", "every rank but 0", "no rank"
# `rank <op> value` tests that split rank 0 from the others; -1 is the usual
# "not distributed" local rank, so `local_rank in [-1, 0]` means rank 0.
RANK_COMPARISONS = {
    (ast.Eq, 0): RANK_ZERO,
    (ast.LtE, 0): RANK_ZERO,
    (ast.Lt, 1): RANK_ZERO,
    (ast.In, frozenset({0})): RANK_ZERO,
    (ast.In, frozenset({-1, 0})): RANK_ZERO,
    (ast.NotEq, 0): OTHER_RANKS,
    (ast.Gt, 0): OTHER_RANKS,
    (ast.GtE, 1): OTHER_RANKS,
    (ast.NotIn, frozenset({0})): OTHER_RANKS,
    (ast.NotIn, frozenset({-1, 0})): OTHER_RANKS,
}
MIRRORED = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}
# A test nested deeper than this (`not not ... rank == 0`, towers of and/or)
# is not a rank test anyone writes; it is read as "any rank may".
MAX_TEST_DEPTH = 32


@dataclass(frozen=True)
class RankBranch:
    """A branch of an `if` that only some ranks take."""

    test_if: ast.If
    branch: str  # "body" or "orelse" (for an early return: the statements after it)
    side: str  # RANK_ZERO, OTHER_RANKS or NO_RANKS


RankPath = tuple[RankBranch, ...]
NO_RANK: RankPath = ()


def narrowed(path: RankPath, test_if: ast.If, branch: str, side: str | None) -> RankPath:
    """`path` with one more branch, if that branch is taken by some ranks only."""
    return path if side is None else (*path, RankBranch(test_if, branch, side))


def some_rank_runs(path: RankPath) -> bool:
    """A path that some rank of a distributed run takes (not the single-process one)."""
    sides = {branch.side for branch in path}
    return NO_RANKS not in sides and not {RANK_ZERO, OTHER_RANKS} <= sides


RANK_CALLS = frozenset({"get_rank", "get_local_rank", "rank", "local_rank"})


def is_rank_expr(expr: ast.expr, script: Script) -> bool:
    """A rank-looking value: `rank`, `args.local_rank`, `dist.get_rank()`, `os.environ["RANK"]`,
    or a name the file passes torch as `rank=` (`proc_id` of an mp.spawn worker)."""
    variable = environment_variable(expr, script)
    if variable is not None:
        return variable in RANK_VARIABLES
    if isinstance(expr, ast.Call):  # Horovod's (and its ports') hvd.rank() too
        return short(script.name_of(expr.func)) in RANK_CALLS or returns_the_rank(script, expr)
    if isinstance(expr, ast.Name | ast.Attribute):
        name = expr.id if isinstance(expr, ast.Name) else expr.attr
        return bool(RANK_NAME.search(name)) or name in script.names_given_as_rank
    return False


# How many of the file's functions deep a returned rank is followed (a port's
# `def hvd_rank(): return dist.get_rank()`, a helper calling it).
MAX_RANK_HELPERS = 2


def returns_the_rank(script: Script, call: ast.Call, depth: int = 0) -> bool:
    """A call of the file's own function whose every return is the rank:
    `def hvd_rank(): return dist.get_rank()`, `return int(os.environ["RANK"])`."""
    if depth >= MAX_RANK_HELPERS or not isinstance(call.func, ast.Name):
        return False
    function = script.functions.get(call.func.id)
    if function is None:
        return False
    returned = [n.value for n in walk(function) if isinstance(n, ast.Return)]
    return bool(returned) and all(
        value is not None and returned_rank(script, value, depth) for value in returned
    )


def returned_rank(script: Script, value: ast.expr, depth: int) -> bool:
    value = without_int(value)
    variable = environment_variable(value, script)
    if variable is not None:
        return variable in RANK_VARIABLES
    if not isinstance(value, ast.Call):
        return False
    return short(script.name_of(value.func)) in RANK_CALLS or returns_the_rank(
        script, value, depth + 1
    )


def without_int(expr: ast.expr) -> ast.expr:
    """`int(os.environ["RANK"])` -> `os.environ["RANK"]`: the value inside int()."""
    if isinstance(expr, ast.Call) and called_name(expr) == "int" and expr.args:
        return expr.args[0]
    return expr


def environment_variable(expr: ast.expr, script: Script) -> str | None:
    """The variable `os.environ["X"]`, `os.environ.get("X", ...)` or `os.getenv("X")` reads.

    torchrun hands each process its rank as RANK and LOCAL_RANK (schedulers and MPI
    as RANK_VARIABLES), so these are ranks too.
    """
    if isinstance(expr, ast.Subscript) and script.name_of(expr.value) == "os.environ":
        key = expr.slice
    elif isinstance(expr, ast.Call) and expr.args:
        reader = script.name_of(expr.func)
        key = expr.args[0] if reader in ("os.environ.get", "os.getenv") else None
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def rank_branch_sides(
    test: ast.expr, script: Script, depth: int = 0
) -> tuple[str | None, str | None]:
    """Who runs the body and who runs the else branch of `if test:` in a distributed run.

    RANK_ZERO, OTHER_RANKS or NO_RANKS; None where any rank may.
    """
    if depth > MAX_TEST_DEPTH:
        return None, None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        body, orelse = rank_branch_sides(test.operand, script, depth + 1)
        return orelse, body
    if isinstance(test, ast.BoolOp):
        parts = [rank_branch_sides(value, script, depth + 1) for value in test.values]
        if isinstance(test.op, ast.And):
            return all_hold_sides(parts)
        # De Morgan: `a or b` is `not (not a and not b)`
        body, orelse = all_hold_sides([(o, b) for b, o in parts])
        return orelse, body
    holds = holds_when_distributed(test, script)
    if holds is not None:
        return (None, NO_RANKS) if holds else (NO_RANKS, None)
    side = (
        rank_comparison_side(test, script)
        or assigned_side(test, script, depth)
        or returned_side(test, script, depth)
    )
    if side is None and rank_zero_value_test(test, script, depth):
        return RANK_ZERO, None  # the else branch: the other ranks, and rank 0 when it set none
    return side, other_side(side)


def rank_zero_value_test(test: ast.expr, script: Script, depth: int) -> bool:
    """`if vae is not None:` (or `if vae:`) where, in the test's own function, `vae`
    is set to None everywhere but inside rank-0 branches (`vae = None; if rank == 0:
    vae = load(...)`, `writer = SummaryWriter(d) if rank == 0 else None`): only rank
    0 can pass the test."""
    name = test
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and is_none(test.comparators[0])
    ):
        name = test.left
    if not isinstance(name, ast.Name):
        return False
    scope = enclosing_scope(test, script)
    if scope is None or name.id in parameter_names(scope):
        return False
    stores = [
        node
        for node in script.scope_nodes(scope)
        if isinstance(node, ast.Name) and node.id == name.id and isinstance(node.ctx, ast.Store)
    ]
    set_on_rank_zero = False
    for store in stores:
        assign = script.parents.get(id(store))
        if not (isinstance(assign, ast.Assign) and assign.targets == [store]):
            return False  # a loop variable, an unpacking, a `with ... as`: any rank's
        if is_none(assign.value):
            continue
        if not (
            inside_rank_zero_branch(assign, scope, script, depth)
            or none_but_on_rank_zero(assign.value, script, depth)
        ):
            return False
        set_on_rank_zero = True
    return set_on_rank_zero


def none_but_on_rank_zero(value: ast.expr, script: Script, depth: int) -> bool:
    """`SummaryWriter(log_dir) if rank == 0 else None` (or `None if rank else ...`)."""
    if not isinstance(value, ast.IfExp):
        return False
    body, orelse = rank_branch_sides(value.test, script, depth + 1)
    if is_none(value.orelse):
        return body == RANK_ZERO
    return is_none(value.body) and orelse == RANK_ZERO


def inside_rank_zero_branch(node: ast.AST, scope: ast.AST, script: Script, depth: int) -> bool:
    """Whether an `if` around `node`, within `scope`, runs that branch on rank 0 only."""
    child, parent = node, script.parents.get(id(node))
    while parent is not None and parent is not scope:
        if isinstance(parent, ast.If) and child is not parent.test:
            body, orelse = rank_branch_sides(parent.test, script, depth + 1)
            if (body if child in parent.body else orelse) == RANK_ZERO:
                return True
        child, parent = parent, script.parents.get(id(parent))
    return False


def enclosing_scope(node: ast.AST, script: Script) -> ast.AST | None:
    """The function (or the module) whose own statements hold `node`."""
    parent = script.parents.get(id(node))
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(parent, (ast.ClassDef, ast.Lambda)):
            return None
        parent = script.parents.get(id(parent))
    return parent or script.tree


def is_rank_stride(script: Script, node: ast.AST) -> bool:
    """`items[rank::world]`, `range(rank, n, world)` or `np.arange(rank, n, world)`:
    this rank's strided share, one longer on the first `n % world` ranks."""
    if (
        isinstance(node, ast.Call)
        and called_name(node) in ("range", "arange")
        and len(node.args) == 3
    ):
        return is_rank_expr(node.args[0], script)
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)):
        return False
    lower, step = node.slice.lower, node.slice.step
    return lower is not None and step is not None and is_rank_expr(lower, script)


def assignments_seen_from(script: Script, node: ast.AST) -> dict[str, list[ast.expr]]:
    """Name -> values assigned in the function that holds `node`, and at module level."""
    scope = enclosing_scope(node, script) or script.tree
    scopes = [script.tree] if scope is script.tree else [script.tree, scope]
    assigned: dict[str, list[ast.expr]] = {}
    for each in scopes:
        for statement in script.scope_nodes(each):
            if isinstance(statement, ast.Assign):
                for target, value in name_value_pairs(statement):
                    assigned.setdefault(target.id, []).append(value)
    return assigned


def returned_side(test: ast.expr, script: Script, depth: int) -> str | None:
    """`is_main()` where the file defines `def is_main(): return dist.get_rank() == 0`;
    `self.is_main` where the class has that as a property (`self.is_main()` a method)."""
    function = tested_helper(test, script)
    body = [
        stmt
        for stmt in (function.body if function else [])
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
    ]  # without its docstring
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    return rank_branch_sides(body[0].value, script, depth + 1)[0]


def tested_helper(test: ast.expr, script: Script) -> Function | None:
    """The file's function a test calls (`is_main()`), or the method of the test's
    own class it calls or reads as a property (`self.is_main()`, `self.is_main`), or
    of the one class of the file that has it (`env.is_main`)."""
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name):
        return script.functions.get(test.func.id)
    called = isinstance(test, ast.Call)
    read = test.func if isinstance(test, ast.Call) else test
    if not isinstance(read, ast.Attribute):
        return None
    if isinstance(read.value, ast.Name) and read.value.id == "self":
        parent = script.parents.get(id(test))
        while parent is not None and not isinstance(parent, ast.ClassDef):
            parent = script.parents.get(id(parent))
        if parent is None:
            return None
        method = script.functions.get(f"{parent.name}.{read.attr}")
    else:
        # `env.is_main`, `self.env.is_main`: another object's, when one class of the
        # file alone has a method of that name (a DistEnv dataclass's property)
        owners = [
            script.functions[name]
            for name in script.methods_by_name.get(read.attr, [])
            if name.count(".") == 1
        ]
        method = owners[0] if len(owners) == 1 else None
    if method is None or called == any(
        isinstance(d, ast.Name) and d.id == "property" for d in method.decorator_list
    ):
        return None  # a property called, or a method read without a call
    return method


def assigned_side(test: ast.expr, script: Script, depth: int) -> str | None:
    """The side of a flag assigned from a rank test: `master_process = rank == 0`
    (nanoGPT), `self.is_master = args.rank % ngpus == 0`, and `trainer.is_main` read
    elsewhere by the field a class of the file sets on itself. Constants assigned to
    the same name (`master_process = True` when not distributed) do not count; tests
    that disagree make it any rank's."""
    if not isinstance(test, (ast.Name, ast.Attribute)):
        return None
    name = source_text(test)
    if name in script.assigned_sides:
        return script.assigned_sides[name]  # known, or being worked out (a cycle): None
    script.assigned_sides[name] = None
    values = script.assigned_values.get(name, [])
    if not values and isinstance(test, ast.Attribute) and source_text(test.value) != "self":
        # `trainer.is_main` in a callback: the field the file's classes set on themselves
        values = script.assigned_values.get(f"self.{test.attr}", [])
    sides = {
        rank_branch_sides(value, script, depth + 1)[0]
        for value in values
        if not isinstance(value, ast.Constant)
    }
    side = sides.pop() if len(sides) == 1 and sides <= {RANK_ZERO, OTHER_RANKS} else None
    script.assigned_sides[name] = side
    return side


def all_hold_sides(parts: list[tuple[str | None, str | None]]) -> tuple[str | None, str | None]:
    """Sides of `a and b and ...`: the body needs every part, the else any one failing."""
    bodies = {body for body, _ in parts} - {None}
    if NO_RANKS in bodies or {RANK_ZERO, OTHER_RANKS} <= bodies:
        body = NO_RANKS
    else:
        body = bodies.pop() if bodies else None
    can_fail = [orelse for _, orelse in parts if orelse != NO_RANKS]
    orelse = NO_RANKS if not can_fail else can_fail[0] if len(can_fail) == 1 else None
    return body, orelse


def holds_when_distributed(test: ast.expr, script: Script) -> bool | None:
    """`dist.is_initialized()` and a flag named for it (`args.distributed`, nanoGPT's
    `ddp`) are true and `local_rank == -1` or `rank is None` false on every rank of a run."""
    if isinstance(test, (ast.Name, ast.Attribute)):
        name = test.id if isinstance(test, ast.Name) else test.attr
        return True if DISTRIBUTED_FLAG.match(name) else None
    if isinstance(test, ast.Call):
        always = short(script.name_of(test.func)) in ("is_initialized", "is_available")
        return True if always else None
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = test.left, test.comparators[0]
        if is_rank_expr(left, script) and int_literal(right) == -1:
            op = type(test.ops[0])
            return {ast.Eq: False, ast.NotEq: True}.get(op)
        if is_rank_expr(left, script) and isinstance(right, ast.Constant) and right.value is None:
            # `rank is None`: the single-process run, where nobody gave a rank
            return {ast.Is: False, ast.IsNot: True}.get(type(test.ops[0]))
    return None


def rank_comparison_side(test: ast.expr, script: Script) -> str | None:
    """`rank == 0`, `rank != 0`, `local_rank in [-1, 0]`, `get_rank() > 0`, `is_main_process()`,
    `accelerator.is_main_process`, `trainer.is_global_zero`."""
    helper = test.func if isinstance(test, ast.Call) else test
    if isinstance(helper, (ast.Name, ast.Attribute)):
        return RANK_ZERO if short(script.name_of(helper)) in MAIN_PROCESS_HELPERS else None
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    left, op, right = test.left, type(test.ops[0]), test.comparators[0]
    if compared_rank(right, script) and op not in (ast.In, ast.NotIn):  # `0 == rank`
        left, right, op = right, left, MIRRORED.get(op, op)
    if not compared_rank(left, script):
        return None
    return RANK_COMPARISONS.get((op, int_literal(right)))


def compared_rank(expr: ast.expr, script: Script) -> bool:
    """A rank on one side of a comparison: a rank, a worker's GPU index, or
    `rank % gpus_per_node` (0 on the first rank of each node, rank 0 among them)."""
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mod):
        divisor = expr.right.func if isinstance(expr.right, ast.Call) else expr.right
        if not PER_NODE.search(script.name_of(divisor)):
            return False  # `rank % 2` splits the ranks otherwise
        expr = expr.left
    if isinstance(expr, (ast.Name, ast.Attribute)):
        name = expr.id if isinstance(expr, ast.Name) else expr.attr
        if GPU_INDEX_NAME.match(name):
            return True
    return is_rank_expr(expr, script)


def other_side(side: str | None) -> str | None:
    """Rank 0 <-> every rank but 0; None for anything else."""
    return {RANK_ZERO: OTHER_RANKS, OTHER_RANKS: RANK_ZERO}.get(side or "")


def int_literal(expr: ast.expr) -> int | frozenset[int] | None:
    """An int constant, or a list / tuple / set of them as a frozenset."""
    if is_int(expr):
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and is_int(expr.operand):
        return -expr.operand.value
    if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
        values = [
            int_literal(e) if not isinstance(e, (ast.List, ast.Tuple, ast.Set)) else None
            for e in expr.elts
        ]
        if all(isinstance(v, int) for v in values):
            return frozenset(values)
    return None
