"""The rough execution trace of a script: which calls run, in which order, on which ranks.

Starting at module level, statements are walked in order, and a call to a
function defined in the same file (`f()`, `Trainer()` for its __init__,
`self.step()`, or a target handed to mp.spawn / Process) is walked in place.
Branches are walked one after the other and loops once; that is rough, but it
is the order a reader would follow, and checks only use it to compare two
calls on the same path. Each call also carries the `if`s on the rank around
it (see ranks.py), so a check can tell who reaches it.

The walk never recurses in Python: each step is a generator that yields the
steps it contains, and `drive` runs them from an explicit stack. A chain of
five thousand functions calling each other is as safe as one. Stepping into
functions is bounded (per trace and for the whole file), so a helper called
from everywhere, or a fan-out that doubles at each level, costs a bounded
amount of work; past the bound the trace still records every call it walks.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from assistant.lint.model import Function, Script, children, unmoved, walk
from assistant.lint.ranks import NO_RANK, RankPath, narrowed, rank_branch_sides
from assistant.lint.torchapi import SPAWNERS

# Past this many calls in one trace, it stops stepping into functions.
MAX_TRACED_CALLS = 20_000
# Past this many calls in all traces of a file together, no trace steps in.
MAX_TRACED_CALLS_PER_FILE = 100_000

Step = Iterator["Step"]  # a generator that yields the steps it contains
Item = TypeVar("Item")


@dataclass(frozen=True)
class TracedCall:
    """One call on the rough execution path."""

    node: ast.Call
    name: str  # dotted name with import aliases resolved ("" if not a plain name)
    top_line: int  # the module-level statement that led here
    guarded: bool  # reached under `if __name__ == "__main__":` (or not at import time)
    rank_path: RankPath  # the `if rank == 0:`-like branches around it, outermost first


@dataclass(frozen=True)
class Where:
    """What every call in a block shares: how it was reached and by which ranks."""

    top_line: int
    guarded: bool
    rank: RankPath

    def with_rank(self, rank: RankPath) -> Where:
        return Where(self.top_line, self.guarded, rank)


class Shared:
    """What all traces of one file share: the budget of calls, and answers worked out once.

    A function called from a hundred places is walked a hundred times; its
    expressions' calls and their names are found the first time only.
    """

    def __init__(self, script: Script, calls: int = MAX_TRACED_CALLS_PER_FILE):
        self.calls_left = calls
        self.names = {id(node): name for node, name in script.call_names}
        self.expression_calls: dict[int, list[ast.Call]] = {}

    def calls_in(self, node: ast.AST) -> list[ast.Call]:
        if id(node) not in self.expression_calls:
            self.expression_calls[id(node)] = calls_in_evaluation_order(node)
        return self.expression_calls[id(node)]


def drive(step: Step) -> None:
    """Run a step and every step it yields, depth first, without recursion."""
    stack = [step]
    while stack:
        try:
            inner = next(stack[-1])
        except StopIteration:
            stack.pop()
            continue
        stack.append(inner)


class Tracer:
    """Walks statements in order, stepping into same-file functions."""

    def __init__(self, script: Script, shared: Shared):
        self.script = script
        self.shared = shared
        self.visited: set[str] = set()
        self.calls: list[TracedCall] = []
        self.active: set[str] = set()  # the functions being walked, to stop recursion
        # The class whose method is being walked (innermost), "" outside methods:
        # `self.m()` there means that class's m.
        self.owners: list[str] = [""]
        # Per function being walked (innermost last): its parameters this call
        # leaves falsy (`accuracy(..., reduce=False)`, or a `reduce=False` default
        # not passed): `if reduce:` there never runs on this path.
        self.falsy: list[frozenset[str]] = [frozenset()]
        # Per function being walked: the strings this call gives its parameters
        # (`self.hook("on_fit_start")`), so `getattr(cb, name)(self)` there names a method.
        self.strings: list[dict[str, str]] = [{}]

    def run_module(self) -> list[TracedCall]:
        drive(self.module())
        return self.calls

    def run_function(self, name: str) -> list[TracedCall]:
        func = self.script.functions[name]
        drive(self.enter(name, func, Where(func.lineno, True, NO_RANK)))
        return self.calls

    def module(self) -> Step:
        for stmt in self.script.tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            yield self.statement(stmt, Where(stmt.lineno, is_main_guard(stmt), NO_RANK))

    def enter(
        self,
        name: str,
        func: ast.AST,
        where: Where,
        falsy: frozenset[str] = frozenset(),
        strings: dict[str, str] | None = None,
    ) -> Step:
        if name in self.active:  # recursion: walk a function once per path
            return
        self.visited.add(name)
        self.active.add(name)
        self.owners.append(name.split(".")[0] if "." in name else self.owners[-1])
        self.falsy.append(falsy)
        self.strings.append(strings or {})
        yield self.block(func.body, where)
        self.strings.pop()
        self.falsy.pop()
        self.owners.pop()
        self.active.discard(name)

    def block(self, stmts: list[ast.stmt], where: Where) -> Step:
        """Statements in order; after `if rank != 0: return` the rest is rank 0's alone."""
        for stmt in stmts:
            yield self.statement(stmt, where)
            if isinstance(stmt, ast.If) and not stmt.orelse and leaves_block(stmt.body):
                _body_side, rest_side = rank_branch_sides(stmt.test, self.script)
                where = where.with_rank(narrowed(where.rank, stmt, "orelse", rest_side))

    def statement(self, stmt: ast.stmt, where: Where) -> Step:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return  # nested definitions run only when called; not followed
        if isinstance(stmt, ast.If):
            yield self.expression(stmt.test, where)
            taken = flag_branch(stmt.test, self.falsy[-1])
            if taken is not None:  # a flag this call fixed: only one branch runs
                yield self.block(stmt.body if taken == "body" else stmt.orelse, where)
                return
            body_side, else_side = rank_branch_sides(stmt.test, self.script)
            yield self.block(
                stmt.body, where.with_rank(narrowed(where.rank, stmt, "body", body_side))
            )
            yield self.block(
                stmt.orelse, where.with_rank(narrowed(where.rank, stmt, "orelse", else_side))
            )
            return
        yield self.fields(stmt, where)

    def fields(self, node: ast.AST, where: Where) -> Step:
        """Every field in order: loop and try bodies, handlers, with-items."""
        for _name, value in ast.iter_fields(node):
            items = value if isinstance(value, list) else [value]
            if items and all(isinstance(item, ast.stmt) for item in items):
                yield self.block(items, where)
                continue
            for item in items:
                if isinstance(item, ast.expr):
                    yield self.expression(item, where)
                elif isinstance(item, ast.AST):  # except handler, with-item, match case
                    yield self.fields(item, where)

    def expression(self, node: ast.AST, where: Where) -> Step:
        """The calls of an expression, arguments before the call that takes them."""
        for call in self.shared.calls_in(node):
            yield from self.call(call, where)

    def call(self, node: ast.Call, where: Where) -> Step:
        name = self.shared.names[id(node)]
        self.calls.append(TracedCall(node, name, where.top_line, where.guarded, where.rank))
        self.shared.calls_left -= 1
        if len(self.calls) > MAX_TRACED_CALLS or self.shared.calls_left < 0:
            return  # a helper called from many places: stop stepping in, keep recording
        for target in self.targets(node, name):
            func = self.script.functions[target]
            # a spawned target gets the spawner's arguments, not this call's
            spawned = name in SPAWNERS
            falsy = frozenset() if spawned else falsy_parameters(func, node, "." in target)
            strings = {} if spawned else string_arguments(func, node, "." in target)
            yield self.enter(target, func, where, falsy, strings)

    def targets(self, node: ast.Call, name: str) -> list[str]:
        """Same-file functions this call runs: the callee, or a spawned target."""
        found = same_file_callees(self.script, node.func, self.owners[-1] or None)
        found += methods_looked_up(self.script, node.func, self.strings[-1])
        if name in SPAWNERS:
            candidates = list(node.args[:1]) + [
                k.value for k in node.keywords if k.arg in ("fn", "target")
            ]
            for arg in candidates:
                if isinstance(arg, ast.Name) and arg.id in self.script.functions:
                    found.append(arg.id)
        return found


def methods_looked_up(script: Script, func: ast.expr, strings: dict[str, str]) -> list[str]:
    """`getattr(cb, "on_epoch_end")(...)`, or `getattr(cb, name)(...)` where this call
    of the enclosing function gave `name` a string: the file's methods of that name
    (a Trainer dispatching a hook to its callbacks), not one other objects have too."""
    if not (
        isinstance(func, ast.Call)
        and isinstance(func.func, ast.Name)
        and func.func.id == "getattr"
        and len(func.args) >= 2
    ):
        return []
    key = func.args[1]
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        method = key.value
    elif isinstance(key, ast.Name) and key.id in strings:
        method = strings[key.id]
    else:
        return []
    if method in COMMON_METHODS or method.startswith("__"):
        return []
    return list(script.methods_by_name.get(method, []))


def string_arguments(func: Function, call: ast.Call, method: bool) -> dict[str, str]:
    """The parameters of `func` this call gives a string constant (passed or default)."""
    return {
        name: value
        for name, value in constant_arguments(func, call, method).items()
        if isinstance(value, str)
    }


FALSY_CONSTANTS = (False, None, 0, "")


def falsy_parameters(func: Function, call: ast.Call, method: bool) -> frozenset[str]:
    """The parameters of `func` this call leaves falsy: passed False / None / 0 / "",
    or not passed with such a default; not those the function assigns again."""
    return frozenset(
        name
        for name, value in constant_arguments(func, call, method).items()
        if value in FALSY_CONSTANTS and not isinstance(value, float)
    )


def constant_arguments(func: Function, call: ast.Call, method: bool) -> dict[str, object]:
    """parameter -> the constant this call gives it (passed, or its default when
    not passed); not the parameters `func` assigns again, nothing at all when
    *args / **kwargs may carry anything."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return {}
    positional = [*func.args.posonlyargs, *func.args.args]
    if method and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    passed: dict[str, ast.expr] = {p.arg: arg for p, arg in zip(positional, call.args)}
    passed.update({k.arg: k.value for k in call.keywords if k.arg})
    defaults = dict(
        zip(
            [p.arg for p in positional][len(positional) - len(func.args.defaults) :],
            func.args.defaults,
        )
    )
    defaults.update(
        {p.arg: d for p, d in zip(func.args.kwonlyargs, func.args.kw_defaults) if d is not None}
    )
    reassigned = assigned_in(func)
    return {
        name: value.value
        for name, value in {**defaults, **passed}.items()
        if isinstance(value, ast.Constant) and name not in reassigned
    }


def assigned_in(func: Function) -> set[str]:
    """Plain names the function binds anew (assignments, loops, with, walrus)."""
    return {
        target.id
        for node in walk(func)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.For | ast.NamedExpr)
        for target in walk(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        if isinstance(target, ast.Name)
    }


def flag_branch(test: ast.expr, falsy: frozenset[str]) -> str | None:
    """ "body" / "orelse": the branch a test of a falsy flag takes; None if not one."""
    if isinstance(test, ast.Name) and test.id in falsy:
        return "orelse"
    if (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and isinstance(test.operand, ast.Name)
        and test.operand.id in falsy
    ):
        return "body"
    return None


def calls_in_evaluation_order(node: ast.AST) -> list[ast.Call]:
    """Calls inside an expression in post-order (not inside lambdas), iteratively."""
    calls: list[ast.Call] = []
    stack: list[tuple[ast.AST, bool]] = [(node, False)]
    while stack:
        current, children_done = stack.pop()
        if children_done:
            if isinstance(current, ast.Call):
                calls.append(current)
            continue
        if isinstance(current, ast.Lambda):
            continue
        stack.append((current, True))
        kids = [c for c in children(current) if not isinstance(c, ast.stmt)]
        stack.extend((child, False) for child in reversed(kids))
    return calls


def same_file_callees(script: Script, func: ast.expr, owner: str | None) -> list[str]:
    """The functions of this file a call runs: `f()`, `Cls()` (its __init__, and the
    __post_init__ a dataclass's generated __init__ calls), `self.m()`, `super().m()`,
    `Cls(args).m()`;
    a method a class inherits from a base of this file is the base's.

    `owner` is the class whose method makes the call; without it `self.m()`
    may be the `m` of any class in the file.
    """
    if isinstance(func, ast.Name):
        if func.id in script.classes:
            built = (script.resolved_method(func.id, m) for m in ("__init__", "__post_init__"))
            return [m for m in built if m]
        return [func.id] if func.id in script.functions else []
    if not isinstance(func, ast.Attribute):
        return []
    if is_super_call(func.value):
        bases = script.classes[owner].bases if owner in script.classes else []
        resolved = (
            script.resolved_method(b.id, func.attr) for b in bases if isinstance(b, ast.Name)
        )
        return [m for m in resolved if m][:1]
    built = func.value
    if (
        isinstance(built, ast.Call)
        and isinstance(built.func, ast.Name)
        and built.func.id in script.classes
    ):  # `Trainer(cfg).fit()`: the method of the instance just built
        return [m for m in (script.resolved_method(built.func.id, func.attr),) if m]
    if not isinstance(func.value, ast.Name):
        return []
    if func.value.id != "self":
        return own_method_of_an_object(script, func.value.id, func.attr)
    if owner is not None:
        return [m for m in (script.resolved_method(owner, func.attr),) if m]
    return list(script.methods_by_name.get(func.attr, []))


def is_super_call(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


# Method names that objects of other kinds have too (containers, tensors, modules,
# optimizers, loggers, files): `x.update()` may be a dict's, so it is not followed.
COMMON_METHODS = frozenset(
    {
        "update", "step", "append", "extend", "add", "get", "set", "items", "keys", "values",
        "pop", "clear", "copy", "forward", "train", "eval", "save", "load", "reset", "close",
        "run", "start", "stop", "log", "compute", "state_dict", "load_state_dict", "to",
        "cuda", "cpu", "zero_grad", "backward", "item", "numpy", "tolist", "mean", "sum",
        "format", "join", "split", "replace", "read", "write", "put", "send", "recv", "wait",
        "sync", "flush", "info", "warning", "error", "debug", "apply", "parameters",
        "modules", "children", "register", "build", "init", "setup", "call", "next",
        "sample", "generate", "predict", "evaluate", "fit", "transform", "encode", "decode",
    }
)  # fmt: skip


def own_method_of_an_object(script: Script, receiver: str, method: str) -> list[str]:
    """`x.m()` on a name that is not a module: where every value the file gives `x`
    builds one of its own classes (`model = ModelPlain(opt)`), the `m` those classes
    run, whatever its name (`model.save(step)`); otherwise the file's methods named
    `m`, when no other kind of object has a method of that name
    (`metric_logger.synchronize_between_processes()`)."""
    if receiver in script.aliases or method.startswith("__"):
        return []
    built = classes_built_as(script, receiver)
    if built:
        resolved = (script.resolved_method(name, method) for name in built)
        return list(dict.fromkeys(m for m in resolved if m))
    if method in COMMON_METHODS:
        return []
    return list(script.methods_by_name.get(method, []))


def callees_with_forwards(script: Script, func: ast.expr) -> list[str]:
    """same_file_callees, and the forward a call runs on an instance of the file's
    own classes (`pfc(embeddings, labels)` with `pfc = PartialFC(...).to(device)`:
    nn.Module's call runs forward, any object's its __call__) or of an autograd
    Function of the file (`DistCrossEntropy.apply(logits, labels)`). Not followed by
    the tracer, whose module calls are judged where they are made."""
    if (
        isinstance(func, ast.Name)
        and func.id not in script.classes
        and func.id not in script.functions
    ):
        resolved = (
            script.resolved_method(cls, "__call__") or script.resolved_method(cls, "forward")
            for cls in classes_built_as(script, func.id)
        )
        return list(dict.fromkeys(m for m in resolved if m))
    if (
        isinstance(func, ast.Attribute)
        and func.attr == "apply"
        and isinstance(func.value, ast.Name)
        and func.value.id in script.classes
    ):
        return [m for m in (script.resolved_method(func.value.id, "forward"),) if m]
    return same_file_callees(script, func, None)


def classes_built_as(script: Script, name: str) -> list[str]:
    """The file's classes `name` is an instance of, where every value the file
    assigns it is such a class's constructor; empty where any is something else."""
    values = [unmoved(value) for value in script.assigned_values.get(name, [])]
    built = [
        value.func.id
        for value in values
        if isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in script.classes
    ]
    return built if values and len(built) == len(values) else []


def trace_script(script: Script) -> list[list[TracedCall]]:
    """The trace from module level, then one per function it never reaches.

    Functions no other function of the file calls go first, so a helper is
    walked from its caller, under the caller's `if rank == 0:`, rather than
    on its own as if every rank ran it.
    """
    shared = Shared(script)
    main = Tracer(script, shared)
    traces = [main.run_module()]
    seen = set(main.visited)
    called = called_by_other_functions(script)
    roots_first = sorted(script.functions, key=lambda name: name in called)
    for name in roots_first:
        if name in seen:
            continue
        tracer = Tracer(script, shared)
        traces.append(tracer.run_function(name))
        seen |= tracer.visited
    return traces


def called_by_other_functions(script: Script) -> set[str]:
    """The file's functions that another function of the file calls."""
    called: set[str] = set()
    for name, function in script.functions.items():
        owner = name.split(".")[0] if "." in name else None
        for node in script.scope_nodes(function):
            if isinstance(node, ast.Call):
                called.update(c for c in same_file_callees(script, node.func, owner) if c != name)
    return called


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


def once_per_call(items: Iterable[Item], call_of: Callable[[Item], TracedCall]) -> Iterator[Item]:
    """`items` without repeats of a call already given: traces share calls (a helper
    reached from two entry points), and a finding is reported once per line."""
    seen: set[int] = set()
    for item in items:
        node = id(call_of(item).node)
        if node not in seen:
            seen.add(node)
            yield item
