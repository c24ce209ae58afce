"""`assistant lint train.py`: static checks of a DDP training script.

The script is parsed with `ast` and never executed (it may start processes,
grab GPUs or hang). Each check is a small function registered in `CHECKS`;
it reads a `Script` (the parsed file plus a rough execution trace) and
yields `Finding`s named by contract cause ids (data/causes.yaml).

The trace is what lets a check say "before init_process_group": starting at
module level, statements are walked in order, and a call to a function
defined in the same file (or handed to mp.spawn / Process) is walked in
place. Branches are walked one after the other and loops once; that is
rough, but it is the order a reader would follow, and checks only use it to
compare two calls on the same path. Each call also carries the `if`s on the
rank around it (`rank == 0`, `local_rank in [-1, 0]`, and the rest of a block
after `if rank != 0: return`), so a check can tell who reaches it.

Checks prefer silence to guessing: a correct modern torchrun script must
produce no findings (tests/data/scripts/correct_*.py).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from assistant.errors import UserError
from assistant.results import Finding

DIST = "torch.distributed"

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
    }
)
# torch.distributed calls that need the default process group.
NEEDS_GROUP = COLLECTIVES | {"get_rank", "get_world_size", "get_backend", "new_group"}

SPAWNERS = frozenset(
    {
        "torch.multiprocessing.spawn",
        "torch.multiprocessing.start_processes",
        "torch.multiprocessing.Process",
        "torch.multiprocessing.Pool",
        "multiprocessing.Process",
        "multiprocessing.Pool",
    }
)
TENSOR_FACTORIES = frozenset(
    {"tensor", "zeros", "ones", "empty", "full", "rand", "randn", "arange"}
)
LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
LOCAL_RANK_NAME = re.compile(r"^(local_rank|localrank|local_rank_id|lrank)$", re.IGNORECASE)
FIXED_CUDA = re.compile(r"^cuda:\d+$")
# Names that hold a rank: rank, local_rank, args.rank_id; not num_ranks or rank_zero.
RANK_NAME = re.compile(r"rank(_?id|_?idx)?$", re.IGNORECASE)
# Stepping into every call site of every helper can grow fast in a large file;
# past this many calls the trace stops stepping into functions.
MAX_TRACED_CALLS = 20_000
MAIN_PROCESS_HELPERS = frozenset({"is_main_process", "is_master", "is_rank_zero", "is_rank0"})
# Who runs a branch under an `if` on the rank: rank 0, every rank but 0, or no rank
# at all in a distributed run (`if local_rank == -1:` is the single-process path).
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


@dataclass(frozen=True)
class TracedCall:
    """One call on the rough execution path."""

    node: ast.Call
    name: str  # dotted name with import aliases resolved ("" if not a plain name)
    top_line: int  # the module-level statement that led here
    guarded: bool  # reached under `if __name__ == "__main__":` (or not at import time)
    rank_path: RankPath  # the `if rank == 0:`-like branches around it, outermost first


@dataclass(frozen=True)
class RankBranch:
    """A branch of an `if` that only some ranks take."""

    test_if: ast.If
    branch: str  # "body" or "orelse" (for an early return: the statements after it)
    side: str  # RANK_ZERO, OTHER_RANKS or NO_RANKS


RankPath = tuple[RankBranch, ...]
NO_RANK: RankPath = ()


@dataclass
class Script:
    """A parsed training script and what the checks need to know about it."""

    path: str
    tree: ast.Module
    aliases: dict[str, str]
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    traces: list[list[TracedCall]] = field(default_factory=list)

    def calls(self) -> Iterator[tuple[ast.Call, str]]:
        """Every call in the file with its resolved name, in source order."""
        found = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        for node in sorted(found, key=lambda n: (n.lineno, n.col_offset)):
            yield node, self.name_of(node.func)

    def name_of(self, expr: ast.expr) -> str:
        """The dotted name of `expr` with its first part resolved through imports."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return ""
        parts.append(self.aliases.get(expr.id, expr.id))
        return ".".join(reversed(parts))

    def finding(self, cause_id: str, node: ast.AST | int, message: str) -> Finding:
        line = node if isinstance(node, int) else node.lineno
        return Finding(cause_id=cause_id, line=line, message=message, path=self.path)


Check = Callable[[Script], Iterator[Finding]]


# ---------------------------------------------------------------- entry points


def lint_script(path: str | Path) -> list[Finding]:
    """Lint a training script on disk; UserError if it is missing or not Python."""
    file = Path(path)
    if not file.exists():
        raise UserError(f"{path}: no such file")
    if file.is_dir():
        raise UserError(f"{path}: is a directory, not a Python script")
    # A stray byte in a comment should not stop the lint; replace it.
    source = file.read_bytes().decode("utf-8", errors="replace")
    return lint_source(source, str(path))


def lint_source(source: str, path: str = "<string>") -> list[Finding]:
    """Lint Python source text; findings sorted by line, then cause id."""
    script = parse_script(source, path)
    findings = {finding for check in CHECKS for finding in check(script)}
    return sorted(findings, key=lambda f: (f.line, f.cause_id, f.message))


def parse_script(source: str, path: str = "<string>") -> Script:
    """Parse `source` into a `Script` with its import aliases and traces."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else path
        raise UserError(f"{where}: not valid Python: {exc.msg}") from None
    except ValueError as exc:  # null bytes on older Pythons
        raise UserError(f"{path}: not valid Python: {exc}") from None
    script = Script(
        path=path, tree=tree, aliases=import_aliases(tree), functions=functions_of(tree)
    )
    script.traces = trace_script(script)
    return script


def functions_of(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Top-level functions by name, and methods of top-level classes as "Class.method".

    Trainers are often classes: their methods are traced like functions, and
    `Trainer(...)` / `self.step()` step into them.
    """
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    functions = {node.name: node for node in tree.body if isinstance(node, defs)}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for method in (node for node in cls.body if isinstance(node, defs)):
            functions[f"{cls.name}.{method.name}"] = method
    return functions


def import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> full dotted name, from every import in the file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


# ---------------------------------------------------------------- the trace


class _Tracer:
    """Walks statements in order, stepping into same-file functions."""

    def __init__(self, script: Script):
        self.script = script
        self.visited: set[str] = set()
        self.calls: list[TracedCall] = []
        self.stack: list[str] = []

    def run_module(self) -> list[TracedCall]:
        for stmt in self.script.tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            guarded = is_main_guard(stmt)
            self.statement(stmt, top_line=stmt.lineno, guarded=guarded, rank=NO_RANK)
        return self.calls

    def run_function(self, name: str) -> list[TracedCall]:
        func = self.script.functions[name]
        self.enter(name, func, top_line=func.lineno, guarded=True, rank=NO_RANK)
        return self.calls

    def enter(self, name: str, func: ast.AST, top_line: int, guarded: bool, rank: RankPath) -> None:
        if name in self.stack:  # recursion: walk a function once per path
            return
        self.visited.add(name)
        self.stack.append(name)
        self.block(func.body, top_line, guarded, rank)
        self.stack.pop()

    def block(self, stmts: list[ast.stmt], top_line: int, guarded: bool, rank: RankPath) -> None:
        """Statements in order; after `if rank != 0: return` the rest is rank 0's alone."""
        for stmt in stmts:
            self.statement(stmt, top_line, guarded, rank)
            if isinstance(stmt, ast.If) and not stmt.orelse and leaves_block(stmt.body):
                _body_side, rest_side = rank_branch_sides(stmt.test, self.script)
                rank = narrowed(rank, stmt, "orelse", rest_side)

    def statement(self, stmt: ast.stmt, top_line: int, guarded: bool, rank: RankPath) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return  # nested definitions run only when called; not followed
        if isinstance(stmt, ast.If):
            self.expression(stmt.test, top_line, guarded, rank)
            body_side, else_side = rank_branch_sides(stmt.test, self.script)
            self.block(stmt.body, top_line, guarded, narrowed(rank, stmt, "body", body_side))
            self.block(stmt.orelse, top_line, guarded, narrowed(rank, stmt, "orelse", else_side))
            return
        self.fields(stmt, top_line, guarded, rank)

    def fields(self, node: ast.AST, top_line: int, guarded: bool, rank: RankPath) -> None:
        """Every field in order: loop and try bodies, handlers, with-items."""
        for _name, value in ast.iter_fields(node):
            items = value if isinstance(value, list) else [value]
            if items and all(isinstance(item, ast.stmt) for item in items):
                self.block(items, top_line, guarded, rank)
                continue
            for item in items:
                if isinstance(item, ast.expr):
                    self.expression(item, top_line, guarded, rank)
                elif isinstance(item, ast.AST):  # except handler, with-item, match case
                    self.fields(item, top_line, guarded, rank)

    def expression(self, node: ast.AST, top_line: int, guarded: bool, rank: RankPath) -> None:
        """Post-order: arguments are evaluated before the call that takes them."""
        if isinstance(node, ast.Lambda):
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                continue
            self.expression(child, top_line, guarded, rank)
        if isinstance(node, ast.Call):
            self.call(node, top_line, guarded, rank)

    def call(self, node: ast.Call, top_line: int, guarded: bool, rank: RankPath) -> None:
        name = self.script.name_of(node.func)
        self.calls.append(TracedCall(node, name, top_line, guarded, rank))
        if len(self.calls) > MAX_TRACED_CALLS:
            return  # a helper called from many places: stop stepping in, keep recording
        for target in self.targets(node, name):
            self.enter(target, self.script.functions[target], top_line, guarded, rank)

    def targets(self, node: ast.Call, name: str) -> list[str]:
        """Same-file functions this call runs: the callee, or a spawned target."""
        owner = next((f for f in reversed(self.stack) if "." in f), "").split(".")[0]
        found = same_file_callees(self.script, node.func, owner or None)
        if name in SPAWNERS:
            candidates = list(node.args[:1]) + [
                k.value for k in node.keywords if k.arg in ("fn", "target")
            ]
            for arg in candidates:
                if isinstance(arg, ast.Name) and arg.id in self.script.functions:
                    found.append(arg.id)
        return found


def same_file_callees(script: Script, func: ast.expr, owner: str | None) -> list[str]:
    """The functions of this file a call runs: `f()`, `Cls()` (its __init__), `self.m()`.

    `owner` is the class whose method makes the call; without it `self.m()`
    may be the `m` of any class in the file.
    """
    functions = script.functions
    if isinstance(func, ast.Name):
        return [c for c in (func.id, f"{func.id}.__init__") if c in functions]
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return []
    if func.value.id != "self":
        return []
    if owner is not None:
        return [m for m in (f"{owner}.{func.attr}",) if m in functions]
    return [name for name in functions if name.endswith(f".{func.attr}")]


def trace_script(script: Script) -> list[list[TracedCall]]:
    """The trace from module level, then one per function it never reaches."""
    main = _Tracer(script)
    traces = [main.run_module()]
    seen = set(main.visited)
    for name in script.functions:
        if name in seen:
            continue
        tracer = _Tracer(script)
        traces.append(tracer.run_function(name))
        seen |= tracer.visited
    return traces


def is_main_guard(stmt: ast.stmt) -> bool:
    """`if __name__ == "__main__":`"""
    if not isinstance(stmt, ast.If) or not isinstance(stmt.test, ast.Compare):
        return False
    sides = [stmt.test.left, *stmt.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    values = {s.value for s in sides if isinstance(s, ast.Constant)}
    return "__name__" in names and "__main__" in values


def leaves_block(stmts: list[ast.stmt]) -> bool:
    """The branch ends in return / raise / continue / break."""
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def narrowed(path: RankPath, test_if: ast.If, branch: str, side: str | None) -> RankPath:
    return path if side is None else (*path, RankBranch(test_if, branch, side))


def is_rank_expr(expr: ast.expr, script: Script) -> bool:
    """A rank-looking value: `rank`, `args.local_rank`, `dist.get_rank()`."""
    if isinstance(expr, ast.Call):
        return short(script.name_of(expr.func)) in ("get_rank", "get_local_rank")
    if isinstance(expr, ast.Name):
        return bool(RANK_NAME.search(expr.id))
    if isinstance(expr, ast.Attribute):
        return bool(RANK_NAME.search(expr.attr))
    return False


def rank_branch_sides(test: ast.expr, script: Script) -> tuple[str | None, str | None]:
    """Who runs the body and who runs the else branch of `if test:` in a distributed run.

    RANK_ZERO, OTHER_RANKS or NO_RANKS; None where any rank may.
    """
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        body, orelse = rank_branch_sides(test.operand, script)
        return orelse, body
    if isinstance(test, ast.BoolOp):
        parts = [rank_branch_sides(value, script) for value in test.values]
        if isinstance(test.op, ast.And):
            return _all_hold_sides(parts)
        # De Morgan: `a or b` is `not (not a and not b)`
        body, orelse = _all_hold_sides([(o, b) for b, o in parts])
        return orelse, body
    holds = _holds_when_distributed(test, script)
    if holds is not None:
        return (None, NO_RANKS) if holds else (NO_RANKS, None)
    side = _rank_comparison_side(test, script)
    return side, _other_side(side)


def _all_hold_sides(parts: list[tuple[str | None, str | None]]) -> tuple[str | None, str | None]:
    """Sides of `a and b and ...`: the body needs every part, the else any one failing."""
    bodies = {body for body, _ in parts} - {None}
    if NO_RANKS in bodies or {RANK_ZERO, OTHER_RANKS} <= bodies:
        body = NO_RANKS
    else:
        body = bodies.pop() if bodies else None
    can_fail = [orelse for _, orelse in parts if orelse != NO_RANKS]
    orelse = NO_RANKS if not can_fail else can_fail[0] if len(can_fail) == 1 else None
    return body, orelse


def _holds_when_distributed(test: ast.expr, script: Script) -> bool | None:
    """`dist.is_initialized()` is true and `local_rank == -1` false on every rank of a run."""
    if isinstance(test, ast.Call):
        always = short(script.name_of(test.func)) in ("is_initialized", "is_available")
        return True if always else None
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = test.left, test.comparators[0]
        if is_rank_expr(left, script) and _literal(right) == -1:
            op = type(test.ops[0])
            return {ast.Eq: False, ast.NotEq: True}.get(op)
    return None


def _rank_comparison_side(test: ast.expr, script: Script) -> str | None:
    """`rank == 0`, `rank != 0`, `local_rank in [-1, 0]`, `get_rank() > 0`, `is_main_process()`."""
    if isinstance(test, ast.Call):
        return RANK_ZERO if short(script.name_of(test.func)) in MAIN_PROCESS_HELPERS else None
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    left, op, right = test.left, type(test.ops[0]), test.comparators[0]
    if is_rank_expr(right, script) and op not in (ast.In, ast.NotIn):  # `0 == rank`
        left, right, op = right, left, MIRRORED.get(op, op)
    if not is_rank_expr(left, script):
        return None
    return RANK_COMPARISONS.get((op, _literal(right)))


def _other_side(side: str | None) -> str | None:
    return {RANK_ZERO: OTHER_RANKS, OTHER_RANKS: RANK_ZERO}.get(side or "")


def _literal(expr: ast.expr) -> int | frozenset[int] | None:
    """An int constant, or a list / tuple / set of them as a frozenset."""
    if is_int(expr):
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and is_int(expr.operand):
        return -expr.operand.value
    if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
        values = [_literal(e) for e in expr.elts]
        if all(isinstance(v, int) for v in values):
            return frozenset(values)
    return None


# ---------------------------------------------------------------- helpers


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_int(expr: ast.expr | None) -> bool:
    return (
        isinstance(expr, ast.Constant)
        and isinstance(expr.value, int)
        and not isinstance(expr.value, bool)
    )


def short(name: str) -> str:
    return name.split(".")[-1]


def is_dist_call(name: str, functions: frozenset[str] | set[str]) -> bool:
    return name.startswith(DIST + ".") and short(name) in functions and name.count(".") == 2


def is_init(name: str) -> bool:
    return short(name) == "init_process_group"


def is_set_device(name: str) -> bool:
    return name.endswith("cuda.set_device")


def is_ddp(name: str) -> bool:
    return short(name) == "DistributedDataParallel"


def init_calls(script: Script) -> list[ast.Call]:
    return [node for node, name in script.calls() if is_init(name)]


def backend_of(call: ast.Call) -> str | None:
    """The literal backend of an init_process_group call, None if absent or computed."""
    value = keyword(call, "backend") or (call.args[0] if call.args else None)
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value.lower()
    return None


def reads_env(script: Script, variable: str) -> bool:
    """True if the string `variable` appears as a literal (os.environ[...], getenv)."""
    return any(isinstance(n, ast.Constant) and n.value == variable for n in ast.walk(script.tree))


def uses_cuda(script: Script) -> bool:
    """`.cuda(...)`, a "cuda..." device string, or an f"cuda:{...}" string."""
    for node in ast.walk(script.tree):
        if isinstance(node, ast.Call) and _is_method(node, "cuda"):
            return True
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (node.value == "cuda" or node.value.startswith("cuda:"))
        ):
            return True
    return False


def local_rank_arguments(script: Script) -> Iterator[tuple[ast.Call, set[str]]]:
    """parser.add_argument calls for the local rank, with the flags they accept."""
    for node, name in script.calls():
        if short(name) != "add_argument":
            continue
        flags = {a.value for a in node.args if isinstance(a, ast.Constant)}
        if flags & set(LOCAL_RANK_FLAGS):
            yield node, flags


# ---------------------------------------------------------------- the checks


def check_missing_main_guard(script: Script) -> Iterator[Finding]:
    """Processes started at import time: spawn children re-run the module."""
    for call in script.traces[0]:
        if call.guarded:
            continue
        if call.name in SPAWNERS:
            what = f"{short(call.name)}() (line {call.node.lineno})"
        elif short(call.name) == "DataLoader" and _positive_workers(call.node):
            what = f"a DataLoader with worker processes (line {call.node.lineno})"
        else:
            continue
        yield script.finding(
            "missing-main-guard",
            call.top_line,
            f"{what} runs at import time; spawned processes re-import the script "
            'and start it again: put it under `if __name__ == "__main__":`',
        )


def _positive_workers(call: ast.Call) -> bool:
    workers = keyword(call, "num_workers")
    return is_int(workers) and workers.value > 0


def check_local_rank_not_from_env(script: Script) -> Iterator[Finding]:
    """A local rank from an argparse default or a constant: every rank picks one GPU."""
    if reads_env(script, "LOCAL_RANK"):
        return
    for node, _flags in local_rank_arguments(script):
        if not _is_required(node) and not _flag_value_read(script, node):
            continue  # the flag only swallows the launcher's; the rank comes from elsewhere
        default = keyword(node, "default")
        shown = ast.unparse(default) if default is not None else "None"
        yield script.finding(
            "local-rank-not-from-env",
            node,
            f"local rank comes from a command-line flag (default {shown}); torchrun passes "
            'none, so every process gets the default: use int(os.environ["LOCAL_RANK"])',
        )
    for node in ast.walk(script.tree):
        if isinstance(node, ast.Assign) and is_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name) and LOCAL_RANK_NAME.match(target.id):
                    yield script.finding(
                        "local-rank-not-from-env",
                        node,
                        f"{target.id} is the constant {node.value.value}: every process "
                        'uses the same GPU; use int(os.environ["LOCAL_RANK"])',
                    )


def check_local_rank_arg_mismatch(script: Script) -> Iterator[Finding]:
    """Only one spelling of the local-rank flag, or a flag torchrun never passes."""
    for node, flags in local_rank_arguments(script):
        accepted = flags & set(LOCAL_RANK_FLAGS)
        problems = []
        if accepted == {"--local_rank"}:
            problems.append(
                "accepts --local_rank only; torch.distributed.launch in PyTorch 2.x passes "
                '--local-rank ("unrecognized arguments: --local-rank=0")'
            )
        elif accepted == {"--local-rank"}:
            problems.append(
                "accepts --local-rank only; launchers before PyTorch 2.0 pass --local_rank"
            )
        if _is_required(node):
            problems.append("the flag is required, but torchrun passes none")
        if problems:
            yield script.finding(
                "local-rank-arg-mismatch", node, "; ".join(problems) + _arg_fix(script, node)
            )


def _arg_fix(script: Script, node: ast.Call) -> str:
    """Where the rank already comes from LOCAL_RANK, only the spellings need fixing."""
    if reads_env(script, "LOCAL_RANK") or not _flag_value_read(script, node):
        return ': accept both spellings, optional: add_argument("--local-rank", "--local_rank")'
    return ': read os.environ["LOCAL_RANK"] (or accept both spellings, optional)'


def _is_required(node: ast.Call) -> bool:
    required = keyword(node, "required")
    return isinstance(required, ast.Constant) and bool(required.value)


def _flag_value_read(script: Script, node: ast.Call) -> bool:
    """The parsed local rank is used in this file: `args.local_rank`, `opt["local_rank"]`."""
    dest = keyword(node, "dest")
    name = dest.value if isinstance(dest, ast.Constant) else "local_rank"
    return any(
        (isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.ctx, ast.Load))
        or (isinstance(n, ast.Constant) and n.value == name)
        for n in ast.walk(script.tree)
    )


def check_hardcoded_device(script: Script) -> Iterator[Finding]:
    """A fixed GPU ("cuda:0", device_ids=[0]) instead of the rank's own device."""
    has_set_device = any(is_set_device(name) for _node, name in script.calls())
    for node, name in script.calls():
        yield from _fixed_cuda_strings(script, node)
        if not has_set_device:
            yield from _current_device_uses(script, node, name)
        if _is_torch_device(name) and len(node.args) == 2 and is_int(node.args[1]):
            yield script.finding(
                "hardcoded-device",
                node,
                f"torch.device(..., {node.args[1].value}) is the same GPU on every rank: "
                "pass local_rank",
            )
        if _is_method(node, "cuda"):
            index = node.args[0] if node.args else keyword(node, "device")
            if is_int(index):
                yield script.finding(
                    "hardcoded-device",
                    node,
                    f".cuda({index.value}) is the same GPU on every rank: use .cuda(local_rank)",
                )
        if is_ddp(name):
            yield from _fixed_ddp_devices(script, node)


def _is_method(node: ast.Call, attr: str) -> bool:
    """`something.attr(...)` where something is not the torch module itself."""
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == attr
        and not (isinstance(func.value, ast.Name) and func.value.id == "torch")
    )


def _is_torch_device(name: str) -> bool:
    return name == "torch.device"


def _fixed_cuda_strings(script: Script, node: ast.Call) -> Iterator[Finding]:
    for arg in [*node.args, *(k.value for k in node.keywords)]:
        if isinstance(arg, ast.Constant) and FIXED_CUDA.match(str(arg.value)):
            yield script.finding(
                "hardcoded-device",
                arg,
                f'"{arg.value}" puts every rank on the same GPU: use '
                'torch.device("cuda", local_rank)',
            )


def _current_device_uses(script: Script, node: ast.Call, name: str) -> Iterator[Finding]:
    """`.cuda()`, `.to("cuda")`, torch.device("cuda"): cuda:0 without set_device."""
    reason = (
        "means the current device, which is cuda:0 in every process unless "
        "torch.cuda.set_device(local_rank) ran first"
    )
    if _is_method(node, "cuda") and not node.args and keyword(node, "device") is None:
        yield script.finding("hardcoded-device", node, f".cuda() without an index {reason}")
        return
    bare = [a for a in node.args if isinstance(a, ast.Constant) and a.value == "cuda"]
    device_kw = keyword(node, "device")
    if _is_method(node, "to") and bare:
        yield script.finding("hardcoded-device", node, f'.to("cuda") {reason}')
    elif _is_torch_device(name) and len(node.args) == 1 and bare:
        yield script.finding("hardcoded-device", node, f'torch.device("cuda") {reason}')
    elif isinstance(device_kw, ast.Constant) and device_kw.value == "cuda":
        yield script.finding("hardcoded-device", node, f'device="cuda" {reason}')


def _fixed_ddp_devices(script: Script, node: ast.Call) -> Iterator[Finding]:
    ids = keyword(node, "device_ids")
    if isinstance(ids, (ast.List, ast.Tuple)) and any(is_int(e) for e in ids.elts):
        yield script.finding(
            "hardcoded-device",
            ids,
            f"device_ids={ast.unparse(ids)} is the same GPU on every rank: use [local_rank]",
        )
    output = keyword(node, "output_device")
    if is_int(output):
        yield script.finding(
            "hardcoded-device",
            output,
            f"output_device={output.value} is the same GPU on every rank: use local_rank",
        )


def check_set_device_order(script: Script) -> Iterator[Finding]:
    """set_device missing with NCCL/CUDA, or called after init_process_group."""
    inits = init_calls(script)
    if not inits:
        return
    set_devices = [node for node, name in script.calls() if is_set_device(name)]
    if not set_devices:
        first = inits[0]
        if keyword(first, "device_id") is not None:
            return  # the communicator is bound to an explicit device
        backend = backend_of(first)
        needs_gpu = "nccl" in backend if backend else uses_cuda(script)
        if needs_gpu:
            yield script.finding(
                "set-device-order",
                first,
                "init_process_group with NCCL/CUDA but torch.cuda.set_device is never "
                "called: every rank's current device is cuda:0; call "
                "torch.cuda.set_device(local_rank) before init_process_group",
            )
        return
    for trace in script.traces:
        first_init = next((i for i, c in enumerate(trace) if is_init(c.name)), None)
        if first_init is None or _set_device_earlier(trace[:first_init]):
            continue
        device_work = None  # the first call after init that already needs the rank's GPU
        for call in trace[first_init + 1 :]:
            if is_set_device(call.name):
                if device_work is not None:
                    yield script.finding(
                        "set-device-order",
                        call.node,
                        "torch.cuda.set_device comes after init_process_group and after "
                        f"{short(device_work.name)} (line {device_work.node.lineno}), which "
                        "already ran on cuda:0: set the device before init_process_group",
                    )
                break
            if device_work is None and _needs_rank_device(call.name):
                device_work = call


def _set_device_earlier(calls: list[TracedCall]) -> bool:
    return any(is_set_device(c.name) for c in calls)


def _needs_rank_device(name: str) -> bool:
    """A call that creates the NCCL communicator (on the current device).

    init_process_group without device_id creates it lazily, at the first
    collective or DDP's first broadcast; setting the device between the two,
    as the PyTorch tutorials do, is early enough.
    """
    return is_dist_call(name, COLLECTIVES) or is_ddp(name)


def check_ddp_device_ids_cpu_module(script: Script) -> Iterator[Finding]:
    """DDP(module, device_ids=...) on a module that was never moved to a device."""
    moved = _moved_names(script)
    for node, name in script.calls():
        if not is_ddp(name) or not node.args:
            continue
        ids = keyword(node, "device_ids")
        if ids is None or (isinstance(ids, ast.Constant) and ids.value is None):
            continue
        module = node.args[0]
        if _is_move(module) or ast.unparse(module) in moved:
            continue
        yield script.finding(
            "ddp-device-ids-cpu-module",
            node,
            f"DDP gets device_ids but {ast.unparse(module)} is never moved to a device "
            "(.to(device) / .cuda(local_rank)): move it first, or drop device_ids on CPU",
        )


def _is_move(expr: ast.expr) -> bool:
    """`x.to(...)`, `x.cuda(...)`, or a constructor given device=..."""
    if not isinstance(expr, ast.Call):
        return False
    if isinstance(expr.func, ast.Attribute) and expr.func.attr in ("to", "cuda"):
        return True
    return keyword(expr, "device") is not None


def _moved_names(script: Script) -> set[str]:
    """Expressions (as source text) that are moved to a device somewhere in the file."""
    moved: set[str] = set()
    for node in ast.walk(script.tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("to", "cuda")
        ):
            moved.add(ast.unparse(node.func.value))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value and _is_move(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            moved.update(ast.unparse(t) for t in targets)
    return moved


def check_process_group_not_initialized(script: Script) -> Iterator[Finding]:
    """torch.distributed calls or DistributedSampler before init_process_group."""
    has_init_anywhere = bool(init_calls(script))
    protected = _calls_behind_is_initialized(script)
    for index, trace in enumerate(script.traces):
        first_init = next((i for i, c in enumerate(trace) if is_init(c.name)), None)
        if first_init is None:
            # Without an init in this file, the group may come from an imported
            # helper: only the module-level path of a file with no init at all
            # and no such helper is reported.
            if has_init_anywhere or index != 0 or _calls_external_setup(script):
                continue
            before, why = trace, "init_process_group is never called in this file"
        else:
            before = trace[:first_init]
            why = f"init_process_group comes later (line {trace[first_init].node.lineno})"
        for call in before:
            if _needs_group(call, protected):
                yield script.finding(
                    "process-group-not-initialized",
                    call.node,
                    f"{short(call.name)}() needs the default process group, but {why}",
                )


def _needs_group(call: TracedCall, protected: set[int]) -> bool:
    if id(call.node) in protected:
        return False
    if is_dist_call(call.name, NEEDS_GROUP):
        return True
    if short(call.name) == "DistributedSampler":
        # With both given explicitly, the sampler never asks the process group.
        return keyword(call.node, "num_replicas") is None or keyword(call.node, "rank") is None
    return False


def _calls_behind_is_initialized(script: Script) -> set[int]:
    """ids of calls under `if dist.is_initialized()` or `dist.is_initialized() and ...`."""
    protected: set[int] = set()
    for node in ast.walk(script.tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            guard = node.test
        elif isinstance(node, ast.BoolOp):
            guard = node
        else:
            continue
        checks = any(
            isinstance(n, ast.Call) and short(script.name_of(n.func)) == "is_initialized"
            for n in ast.walk(guard)
        )
        if checks:
            protected.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Call))
    return protected


def _calls_external_setup(script: Script) -> bool:
    """A call to an imported, non-torch function that may set up distributed."""
    for node, name in script.calls():
        root = node.func
        while isinstance(root, ast.Attribute):
            root = root.value
        imported = isinstance(root, ast.Name) and root.id in script.aliases
        if name.startswith("torch") or not imported:
            continue
        if re.search(r"dist|setup|init", short(name), re.IGNORECASE):
            return True
    return False


def check_collective_mismatch(script: Script) -> Iterator[Finding]:
    """A collective that only rank 0 (or only the other ranks) reaches: the rest hang."""
    blocks = statement_blocks(script.tree)
    reaches: dict[str, _CollectiveReach] = {}
    for trace in script.traces:
        for call in trace:
            if not call.rank_path or not is_dist_call(call.name, COLLECTIVES):
                continue
            if not _some_rank_runs(call.rank_path):
                continue  # the single-process path, or tests no rank passes together
            collective = short(call.name)
            reach = reaches.setdefault(collective, _CollectiveReach(script, collective, blocks))
            # Innermost first: a paired `if` inside can still sit in a rank-0-only caller.
            lonely = next((b for b in reversed(call.rank_path) if not reach.answered(b)), None)
            if lonely is None:
                continue
            yield script.finding(
                "collective-mismatch",
                call.node,
                f"{collective}() runs on {lonely.side} (the `if` on line {lonely.test_if.lineno}); "
                "every rank must call each collective, or the others hang",
            )


def _some_rank_runs(path: RankPath) -> bool:
    sides = {branch.side for branch in path}
    return NO_RANKS not in sides and not {RANK_ZERO, OTHER_RANKS} <= sides


def statement_blocks(tree: ast.Module) -> dict[int, list[ast.stmt]]:
    """id of each statement -> the statement list (body, else, loop body) it is in."""
    blocks: dict[int, list[ast.stmt]] = {}
    for node in ast.walk(tree):
        for _name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                blocks.update((id(stmt), value) for stmt in value)
    return blocks


class _CollectiveReach:
    """Which statements reach one collective, directly or through same-file functions."""

    def __init__(self, script: Script, collective: str, blocks: dict[int, list[ast.stmt]]):
        self.script = script
        self.collective = collective
        self.blocks = blocks
        self.functions: dict[str, bool] = {}

    def answered(self, branch: RankBranch) -> bool:
        """The ranks outside `branch` reach it too: in the other branch, or in a paired `if`."""
        test_if = branch.test_if
        other = test_if.orelse if branch.branch == "body" else test_if.body
        return self.statements(other) or self.paired(test_if)

    def paired(self, test_if: ast.If) -> bool:
        """`if rank != 0: barrier()` ... `if rank == 0: barrier()`: each rank calls it once."""
        unmatched: list[tuple[ast.If, str]] = []
        for stmt in self.blocks.get(id(test_if), []):
            side = self.reaching_side(stmt)
            if side is None:
                continue
            partner = next((u for u in reversed(unmatched) if u[1] == _other_side(side)), None)
            if partner is None:
                unmatched.append((stmt, side))
                continue
            unmatched.remove(partner)
            if test_if is stmt or test_if is partner[0]:
                return True
        return False

    def reaching_side(self, stmt: ast.stmt) -> str | None:
        """For an `if` on the rank that reaches the collective in one branch only: who runs it."""
        if not isinstance(stmt, ast.If):
            return None
        body_side, else_side = rank_branch_sides(stmt.test, self.script)
        in_body, in_else = self.statements(stmt.body), self.statements(stmt.orelse)
        if in_body == in_else:
            return None
        side = body_side if in_body else else_side
        return side if side in (RANK_ZERO, OTHER_RANKS) else None

    def statements(self, stmts: list[ast.stmt]) -> bool:
        return any(
            self.call(node)
            for stmt in stmts
            for node in ast.walk(stmt)
            if isinstance(node, ast.Call)
        )

    def call(self, node: ast.Call) -> bool:
        if short(self.script.name_of(node.func)) == self.collective:
            return True
        return any(self.function(f) for f in same_file_callees(self.script, node.func, None))

    def function(self, name: str) -> bool:
        if name not in self.functions:
            self.functions[name] = False  # a recursive call adds nothing
            self.functions[name] = self.statements(self.script.functions[name].body)
        return self.functions[name]


def check_nccl_with_cpu_tensors(script: Script) -> Iterator[Finding]:
    """A collective on the nccl backend gets a tensor created on the CPU."""
    if not any((backend_of(c) or "").startswith("nccl") for c in init_calls(script)):
        return
    for func in [script.tree, *script.functions.values()]:
        cpu_tensors = _cpu_tensor_names(script, func)
        for node in _own_nodes(func):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = script.name_of(node.func)
            tensor = node.args[0]
            if (
                is_dist_call(name, COLLECTIVES - {"barrier", "monitored_barrier"})
                and isinstance(tensor, ast.Name)
                and tensor.id in cpu_tensors
            ):
                yield script.finding(
                    "nccl-with-cpu-tensors",
                    node,
                    f"{short(name)}({tensor.id}) on the nccl backend, but {tensor.id} is "
                    f"created on the CPU (line {cpu_tensors[tensor.id]}): create it with "
                    "device=... or move it with .to(device)",
                )


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a module or function body, not of the functions nested in it."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        yield from _own_nodes(child)


def _cpu_tensor_names(script: Script, scope: ast.AST) -> dict[str, int]:
    """Names whose every assignment in `scope` is a torch factory without device=."""
    made_on_cpu: dict[str, int] = {}
    elsewhere: set[str] = set()
    for node in _own_nodes(scope):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if not isinstance(target, ast.Name):
                continue
            value = node.value
            if (
                isinstance(value, ast.Call)
                and script.name_of(value.func) in {f"torch.{f}" for f in TENSOR_FACTORIES}
                and keyword(value, "device") is None
            ):
                made_on_cpu.setdefault(target.id, node.lineno)
            else:
                elsewhere.add(target.id)
    # In-place moves such as `t = t.cuda()` count as another assignment above.
    return {name: line for name, line in made_on_cpu.items() if name not in elsewhere}


def check_world_size_mismatch(script: Script) -> Iterator[Finding]:
    """init_process_group with a hard-coded world_size or rank."""
    constants = module_int_constants(script)
    for node in init_calls(script):
        for name in ("world_size", "rank"):
            value = keyword(node, name)
            if is_int(value):
                fixed, source = value.value, f"{name}={value.value}"
            elif isinstance(value, ast.Name) and value.id in constants:
                fixed = constants[value.id]
                source = f"{name}={value.id}, {value.id} = {fixed}"
            else:
                continue
            yield script.finding(
                "world-size-mismatch",
                value,
                f"hard-coded {source} in init_process_group: "
                + (
                    f"if the launcher starts other than {fixed} processes, rendezvous"
                    if name == "world_size"
                    else f"every process claims rank {fixed}, so rendezvous"
                )
                + " waits and times out; leave it out under torchrun "
                "(env://) or pass the spawned rank and the real world size",
            )


def module_int_constants(script: Script) -> dict[str, int]:
    """Module-level names assigned exactly once, to an int literal (WORLD_SIZE = 4)."""
    values: dict[str, int] = {}
    assigned: Counter[str] = Counter()
    for node in ast.walk(script.tree):
        targets = list(node.targets) if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Name):
                assigned[target.id] += 1
    for node in script.tree.body:
        if isinstance(node, ast.Assign) and is_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    return {name: value for name, value in values.items() if assigned[name] == 1}


CHECKS: list[Check] = [
    check_missing_main_guard,
    check_local_rank_not_from_env,
    check_local_rank_arg_mismatch,
    check_hardcoded_device,
    check_set_device_order,
    check_ddp_device_ids_cpu_module,
    check_process_group_not_initialized,
    check_collective_mismatch,
    check_nccl_with_cpu_tensors,
    check_world_size_mismatch,
]
"""Every check `lint_source` runs, in the order they are documented."""
