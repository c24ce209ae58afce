"""The script as the checks see it: reading and parsing it, and the `Script` model.

Everything a hostile file can do to the linter is stopped here or bounded
here: a missing file, a directory, a device or pipe (reading would never
end), a file too big to be a training script, bytes that are not UTF-8,
text that is not Python, nesting deeper than Python's own parser follows.
Each becomes a one-line `UserError`; a file that parses is linted.

The walks over the tree are iterative (`walk` and explicit stacks), so a
deep expression that parses costs no recursion here.
"""

from __future__ import annotations

import ast
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, TypeVar

from assistant.errors import UserError
from assistant.results import Finding

if TYPE_CHECKING:  # the tracer builds the traces and imports this module
    from assistant.lint.tracer import TracedCall

# A training script is a few thousand lines; past this size the file is
# something else (a dump, a bundle), and parsing it costs seconds per MiB.
MAX_SCRIPT_BYTES = 1024 * 1024
# Real code has about 0.13 syntax nodes per character (torch's largest files,
# transformers' trainer.py); a file of a million tiny expressions is not a
# training script, and would cost a gigabyte and seconds per check.
MAX_NODES = 300_000
# Message text for an expression: long or deep ones are shown by their line.
MAX_SHOWN_CHARS = 60
MAX_SHOWN_DEPTH = 40

Function = ast.FunctionDef | ast.AsyncFunctionDef


# torch calls whose `rank=` says which process this is.
RANK_TAKERS = frozenset({"init_process_group", "DistributedSampler"})


T = TypeVar("T")


@dataclass
class Script:
    """A parsed training script and what the checks need to know about it."""

    path: str
    tree: ast.Module
    nodes: list[ast.AST]  # every node of the file, walked once: checks filter this list
    aliases: dict[str, str]
    functions: dict[str, Function]
    traces: list[list[TracedCall]] = field(default_factory=list)
    # id(scope) -> (scope, its own nodes): the scope is kept to tell a node of another
    # tree that took a freed node's id from the one cached
    scope_nodes_cache: dict[int, tuple[ast.AST, list[ast.AST]]] = field(
        default_factory=dict, repr=False
    )
    # ranks.assigned_side per flag name, worked out once: a field assigned in many
    # places from other such fields otherwise costs exponential time.
    assigned_sides: dict[str, str | None] = field(default_factory=dict, repr=False)
    source: str = field(default="", repr=False)  # the text: its docstring's launch lines
    of_type_cache: dict[object, list[ast.AST]] = field(default_factory=dict, repr=False)

    def function_called(self, node: ast.AST) -> Function | None:
        """The file's function a call by plain name runs (`shard(n, rank)` of `def
        shard`), if any; None for anything else (a method, a library's function)."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return self.functions.get(node.func.id)
        return None

    def of_type(self, kinds: type | tuple | UnionType) -> list[ast.AST]:
        """The file's nodes of `kinds` (what isinstance takes), in walk order.

        Filtered once per kind for all checks: a hundred scans of every node per
        file, one per check that looks for assignments or calls, were the
        linter's largest shared cost."""
        if kinds not in self.of_type_cache:
            self.of_type_cache[kinds] = [n for n in self.nodes if isinstance(n, kinds)]
        return self.of_type_cache[kinds]

    def scope_nodes(self, scope: ast.AST) -> list[ast.AST]:
        """`own_nodes(scope)`, computed once per scope for all checks."""
        cached = self.scope_nodes_cache.get(id(scope))
        if cached is None or cached[0] is not scope:
            cached = self.scope_nodes_cache[id(scope)] = (scope, list(own_nodes(scope)))
        return cached[1]

    @cached_property
    def call_names(self) -> list[tuple[ast.Call, str]]:
        """Every call in the file with its resolved name, in source order."""
        found = sorted(self.of_type(ast.Call), key=lambda n: (n.lineno, n.col_offset))
        return [(node, self.name_of(node.func)) for node in found]

    @cached_property
    def called_short_names(self) -> frozenset[str]:
        """The last name of everything the file calls ("Accelerator", "set_start_method")."""
        return frozenset(short(name) for _node, name in self.call_names)

    @cached_property
    def string_constants(self) -> frozenset[str]:
        """Every string literal in the file ("LOCAL_RANK", "cuda:0", ...)."""
        return frozenset(n.value for n in self.of_type(ast.Constant) if isinstance(n.value, str))

    @cached_property
    def every_parameter_name(self) -> frozenset[str]:
        """The names any function or lambda of the file takes as parameters."""
        lambdas = self.of_type(ast.Lambda)
        return frozenset().union(*(parameter_names(s) for s in [*self.all_scopes, *lambdas]))

    @cached_property
    def classes(self) -> dict[str, ast.ClassDef]:
        """The file's top-level classes by name."""
        return {node.name: node for node in self.tree.body if isinstance(node, ast.ClassDef)}

    def resolved_method(self, class_name: str, method: str) -> str | None:
        """ "Class.method" that `Cls(...).method()` runs: the class's own, else the
        first of its bases in this file that defines it (a library base's is not
        the file's)."""
        seen: set[str] = set()
        pending = [class_name]
        while pending:
            name = pending.pop(0)
            if name in seen or name not in self.classes:
                continue
            seen.add(name)
            if f"{name}.{method}" in self.functions:
                return f"{name}.{method}"
            pending += [b.id for b in self.classes[name].bases if isinstance(b, ast.Name)]
        return None

    @cached_property
    def methods_by_name(self) -> dict[str, list[str]]:
        """The file's methods ("Class.method") by method name, for `self.method()` (and
        `obj.method()` where no other kind of object has such a method: tracer.py)."""
        methods: dict[str, list[str]] = {}
        for qualified in self.functions:
            if "." in qualified:
                methods.setdefault(qualified.split(".")[1], []).append(qualified)
        return methods

    @cached_property
    def all_scopes(self) -> list[ast.AST]:
        """The module and every function in it, nested ones (callbacks, closures) too."""
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        return [self.tree, *(node for node in self.of_type(defs))]

    @cached_property
    def assigned_values(self) -> dict[str, list[ast.expr]]:
        """What each plain name or attribute (`master_process`, `self.is_master`) is
        assigned anywhere in the file, by its source text; `a, b = x, y` name by name."""
        values: dict[str, list[ast.expr]] = {}
        for node in self.nodes:
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and depth_of(target, 8) < 8:
                values.setdefault(source_text(target), []).append(node.value)
            for name, value in name_value_pairs(node):
                values.setdefault(name.id, []).append(value)
        return values

    @cached_property
    def names_given_as_rank(self) -> frozenset[str]:
        """Plain names and fields the file hands to torch as a rank
        (`init_process_group(..., rank=proc_id)`, `DistributedSampler(ds, rank=i)`):
        ranks whatever they are called (ranks.is_rank_expr)."""
        return frozenset(
            value.id if isinstance(value, ast.Name) else value.attr
            for call, name in self.call_names
            if short(name) in RANK_TAKERS
            for value in [keyword(call, "rank")]
            if isinstance(value, ast.Name | ast.Attribute)
        )

    @cached_property
    def parents(self) -> dict[int, ast.AST]:
        """Each node's parent by the child's id, for checks that look outward from a node."""
        return {id(child): node for node in self.nodes for child in children(node)}

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


# ---------------------------------------------------------------- reading and parsing


def read_script(path: str | Path) -> str:
    """The text of a script on disk; UserError for anything that is not a readable file."""
    file = Path(path)
    try:
        info = file.stat()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UserError(f"{path}: is a directory, not a Python script")
    if not stat.S_ISREG(info.st_mode):
        # A FIFO or /dev/zero would block or never end.
        raise UserError(f"{path}: not a regular file, not a Python script")
    if info.st_size > MAX_SCRIPT_BYTES:
        raise UserError(
            f"{path}: {info.st_size / 2**20:.1f} MiB is too big for a training script "
            f"(lint reads up to {MAX_SCRIPT_BYTES // 2**20} MiB)"
        )
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    # A stray byte in a comment should not stop the lint; replace it.
    return data.decode("utf-8-sig", errors="replace")


def parse_script(source: str, path: str = "<string>") -> Script:
    """Parse `source` into a `Script` with its import aliases and functions (no traces)."""
    if len(source) > MAX_SCRIPT_BYTES:
        raise UserError(f"{path}: too big for a training script ({len(source)} characters)")
    try:
        # A byte-order mark is fine in a file, but ast.parse of a str rejects it.
        tree = ast.parse(source.removeprefix("\ufeff"), filename=path)
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else path
        raise UserError(f"{where}: not valid Python: {exc.msg}") from None
    except ValueError as exc:  # null bytes on older Pythons
        raise UserError(f"{path}: not valid Python: {exc}") from None
    except (RecursionError, MemoryError):
        # `a + a + ... + a` a hundred thousand times: Python's parser gives up.
        raise UserError(f"{path}: nested too deeply for Python's parser; not linted") from None
    nodes = list(walk(tree))
    if len(nodes) > MAX_NODES:
        raise UserError(
            f"{path}: {len(nodes):,} syntax nodes is too many for a training script "
            f"(lint follows up to {MAX_NODES:,})"
        )
    return Script(
        path=path,
        tree=tree,
        nodes=nodes,
        aliases=import_aliases(nodes),
        functions=functions_of(tree),
        source=source,
    )


def functions_of(tree: ast.Module) -> dict[str, Function]:
    """Top-level functions by name, and methods of top-level classes as "Class.method".

    Trainers are often classes: their methods are traced like functions, and
    `Trainer(...)` / `self.step()` step into them.
    """
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    functions = {node.name: node for node in tree.body if isinstance(node, defs)}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        for method in (node for node in cls.body if isinstance(node, defs)):
            functions[f"{cls.name}.{method.name}"] = method
    # A function defined inside another (`def save(tag):` in main) is called by its
    # plain name there: it is known by that name when no other function has it.
    nested: dict[str, list[Function]] = {}
    for outer in list(functions.values()):
        for node in walk(outer):
            if node is not outer and isinstance(node, defs):
                nested.setdefault(node.name, []).append(node)
    for name, found in nested.items():
        if len(found) == 1 and name not in functions:
            functions[name] = found[0]
    return functions


def import_aliases(nodes: list[ast.AST]) -> dict[str, str]:
    """Local name -> full dotted name, from every import among the file's nodes."""
    aliases: dict[str, str] = {}
    for node in nodes:
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


# ---------------------------------------------------------------- small AST helpers


def called_name(call: ast.Call) -> str:
    """What a call calls, by its last name: `torch.zeros_like(x)` -> "zeros_like",
    `x.clone()` -> "clone", `len(x)` -> "len"; "" for `f()()` and the like."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def bound_arguments(
    function: Function, call: ast.Call, self_bound: bool = False
) -> list[tuple[str | None, ast.expr]]:
    """(parameter, argument) for each argument of a call of `function`: positional
    ones by place, keywords by name; None where it lands in *args / **kwargs
    or past the parameters. `self_bound`: the call binds the first parameter itself
    (a method called through its instance, `model(x)` of forward, or a class
    through its constructor, `Model(lr, steps)` of __init__)."""
    parameters = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
    if self_bound:
        parameters = parameters[1:]
    named = parameters + [a.arg for a in function.args.kwonlyargs]
    bound: list[tuple[str | None, ast.expr]] = [
        (parameters[index] if index < len(parameters) else None, argument)
        for index, argument in enumerate(call.args)
        if not isinstance(argument, ast.Starred)
    ]
    bound += [(k.arg if k.arg in named else None, k.value) for k in call.keywords]
    return bound


def method_of(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    """The class's own method `name` (not an inherited one), if it defines it."""
    return next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == name), None)


def name_value_pairs(node: ast.Assign) -> list[tuple[ast.Name, ast.expr]]:
    """(name, value) of an assignment to plain names: `t = v`, and `a, b = x, y`
    paired name by name (a tuple unpacked from one call pairs nothing)."""
    pairs = []
    for target in node.targets:
        if isinstance(target, ast.Name):
            pairs.append((target, node.value))
        elif (
            isinstance(target, ast.Tuple)
            and isinstance(node.value, ast.Tuple)
            and len(target.elts) == len(node.value.elts)
        ):
            pairs += [
                (name, value)
                for name, value in zip(target.elts, node.value.elts)
                if isinstance(name, ast.Name)
            ]
    return pairs


def sole_name_target(node: ast.AST | None) -> str | None:
    """The one plain name an assignment binds (`cfg = sample(space)` -> "cfg"), else None."""
    if (
        isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
    ):
        return node.targets[0].id
    return None


def names_given(nodes: Iterable[ast.AST], accepts: Callable[[ast.expr], bool]) -> set[str]:
    """The plain names the assignments among `nodes` bind to a value `accepts` takes
    (`L = max(len(s) for s in seqs)` for a measure of the items, `m = m.cuda()` for a move)."""
    return {
        target.id
        for node in nodes
        if isinstance(node, ast.Assign) and accepts(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    """The value of `name=` in a call, None if absent."""
    return next((k.value for k in call.keywords if k.arg == name), None)


def string_keyed_entries(expr: ast.expr) -> list[tuple[str, ast.expr]]:
    """(key, value) of each string-keyed entry of a dict written out: `{"model": m}`
    or `dict(model=m)`, the two ways checkpoints are built."""
    if isinstance(expr, ast.Dict):
        return [
            (key.value, value)
            for key, value in zip(expr.keys, expr.values, strict=True)
            if isinstance(key, ast.Constant) and isinstance(key.value, str)
        ]
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
        return [(k.arg, k.value) for k in expr.keywords if k.arg is not None]
    return []


def is_int(expr: ast.expr | None) -> bool:
    """An int literal (not a bool)."""
    return (
        isinstance(expr, ast.Constant)
        and isinstance(expr.value, int)
        and not isinstance(expr.value, bool)
    )


def short(name: str) -> str:
    """The last part of a dotted name."""
    return name.split(".")[-1]


def names_bound_to(script: Script, class_name: str) -> set[str]:
    """What the file binds to `class_name(...)`, or to a helper of the file returning
    one (`model = FSDP(model)`, `self.model = wrap(model)`), by source text."""
    return {
        source_text(target)
        for node in script.of_type(ast.Assign)
        if isinstance(node.value, ast.Call)
        if any(
            short(script.name_of(call.func)) == class_name
            for call in [node.value, *returned_calls(script, node.value)]
        )
        for target in node.targets
    }


def returned_calls(script: Script, call: ast.expr) -> list[ast.Call]:
    """The calls a same-file function returns, as `call` of it builds them:
    `return FSDP(model, ...)`, or `wrapped = FSDP(...)` ... `return wrapped`."""
    function = script.function_called(call)
    if function is None:
        return []
    own = script.scope_nodes(function)
    found: list[ast.Call] = []
    for node in own:
        if not (isinstance(node, ast.Return) and node.value is not None):
            continue
        if isinstance(node.value, ast.Call):
            found.append(node.value)
        elif isinstance(node.value, ast.Name):
            found += [
                assign.value
                for assign in own
                if isinstance(assign, ast.Assign)
                and isinstance(assign.value, ast.Call)
                and any(isinstance(t, ast.Name) and t.id == node.value.id for t in assign.targets)
            ]
    return found


def parameter_defaults(function: Function) -> dict[str, ast.expr]:
    """A function's parameters that have a default, name -> the default."""
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    paired = zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults)
    defaults = {a.arg: d for a, d in paired}
    defaults.update(
        {a.arg: d for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None}
    )
    return defaults


def parameter_names(scope: ast.AST) -> set[str]:
    """Every name a function's (or a lambda's) parameters bind (none for the module)."""
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return set()
    arguments = scope.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return {argument.arg for argument in every}


# Expressions that bind loop variables of their own, visible only inside them.
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def names_in(node: ast.AST) -> set[str]:
    """Every plain name read or bound anywhere in `node`."""
    return {n.id for n in walk(node) if isinstance(n, ast.Name)}


def is_none(expr: ast.expr) -> bool:
    """The literal None."""
    return isinstance(expr, ast.Constant) and expr.value is None


def children(node: ast.AST) -> tuple[ast.AST, ...]:
    """`ast.iter_child_nodes(node)`, listed once and kept on the node: the checks walk
    the same trees hundreds of times, and listing children took a third of lint's
    time (session 48: a sample of 220 blind scripts, 15.8 s -> 10.9 s of CPU).
    A parsed tree is never changed afterwards, so the list stays true."""
    try:
        return node._children  # type: ignore[attr-defined]
    except AttributeError:
        listed = node._children = tuple(ast.iter_child_nodes(node))  # type: ignore[attr-defined]
        return listed


def walk(node: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk` over `children`: the same nodes in the same (breadth-first) order."""
    pending = deque([node])
    while pending:
        current = pending.popleft()
        pending.extend(children(current))
        yield current


def truth_at_count(test: ast.expr, is_count: Callable[[ast.expr], bool], count: int) -> bool | None:
    """The value of `test` when every count it reads (what `is_count` recognises:
    `len(x)`, `x.shape[0]`, a name holding one) is `count`: at 0, `n > 0` is
    False and `not x.numel()` True; at 1, `len(x) == 1` is True. None for a test
    of anything else. The checks that read "the batch holds no items" (or one)
    ask it, each with its own idea of what counts the batch."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = truth_at_count(test.operand, is_count, count)
        return None if inner is None else not inner
    if is_count(test):
        return count != 0
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    bound = test.comparators[0]
    if not (is_count(test.left) and isinstance(bound, ast.Constant) and type(bound.value) is int):
        return None
    compared = COMPARISONS.get(type(test.ops[0]))
    return None if compared is None else compared(count, bound.value)


COMPARISONS: dict[type, Callable[[int, int], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}


def own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a module or function body in source order, not of functions nested in it."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    stack = list(reversed(list(children(scope))))
    while stack:
        node = stack.pop()
        if isinstance(node, nested):
            continue
        yield node
        stack.extend(reversed(list(children(node))))


def self_attribute(node: ast.AST) -> str | None:
    """ "model" for `self.model` (a field of the class being written); None otherwise."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


MOVES = frozenset({"cuda", "to", "float", "half", "bfloat16"})


def unmoved(value: ast.expr, methods: frozenset[str] = MOVES) -> ast.expr:
    """`nn.DataParallel(net).cuda()` -> the DataParallel call: a move keeps the wrapper
    (and, with `methods`, other calls that keep what they are called on)."""
    while (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr in methods
    ):
        value = value.func.value
    return value


def depth_of(node: ast.AST, limit: int) -> int:
    """How deep the tree under `node` goes, counting no further than `limit`."""
    deepest = 0
    stack = [(node, 1)]
    while stack and deepest < limit:
        current, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children(current))
    return deepest


# Calls that read a file back: open() and the loaders of json, pickle, torch, numpy, pandas.
FILE_READERS = frozenset(
    {"open", "load", "loads", "loadtxt", "read_csv", "read_json", "read_parquet"}
)


def files_opened(nodes: Iterable[ast.AST]) -> dict[str, ast.expr]:
    """Handle name -> the path `open()` was given, for each `with open(path) as
    handle` among `nodes` (the first, where a name is opened twice)."""
    opened: dict[str, ast.expr] = {}
    for node in nodes:
        if not isinstance(node, ast.With | ast.AsyncWith):
            continue
        for item in node.items:
            call = item.context_expr
            if (
                isinstance(item.optional_vars, ast.Name)
                and isinstance(call, ast.Call)
                and called_name(call) == "open"
                and call.args
            ):
                opened.setdefault(item.optional_vars.id, call.args[0])
    return opened


def position(node: ast.AST) -> tuple[int, int]:
    """Where a node starts, to compare nodes in source order."""
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def enclosing_loop(node: ast.AST, parents: dict[int, ast.AST]) -> ast.For | ast.While | None:
    """The nearest loop around `node` in the same function."""
    parent = parents.get(id(node))
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(parent, (ast.For, ast.While)):
            return parent
        parent = parents.get(id(parent))
    return None


def full_text(expr: ast.AST) -> str:
    """`expr`'s whole source text, for a search of what it names: source_text
    abbreviates a long one, which would hide a `world_size` at its end. A deep
    expression reads as empty (ast.unparse recurses once per level)."""
    text = unparsed(expr)
    return "" if text is None else text


# Facts about a node (its source text; a loop's assignments, read once for all the
# skips in it) are kept on the node itself: the checks ask them of the same nodes
# hundreds of times per file (an eighth of the lint time went to ast.unparse and
# its depth test; a loop walked once per statement of it is quadratic), and they
# live and die with the tree they were read from, which belongs to one script.
# No check changes a parsed node.
FACTS_ATTRIBUTE = "_assistant_facts"


def node_fact(node: ast.AST, question: str, compute: Callable[[], T]) -> T:
    """`compute()`, worked out once per node for `question` (a fact of the node, or of
    the node in its script: a tree belongs to one Script)."""
    facts = node.__dict__.setdefault(FACTS_ATTRIBUTE, {})
    if question not in facts:
        facts[question] = compute()
    return facts[question]


def unparsed(expr: ast.AST) -> str | None:
    """ast.unparse of `expr`, once per node; None when it is too deep to unparse."""
    return node_fact(
        expr,
        "text",
        lambda: (
            None if depth_of(expr, MAX_SHOWN_DEPTH + 1) > MAX_SHOWN_DEPTH else ast.unparse(expr)
        ),
    )


def source_text(expr: ast.AST) -> str:
    """`expr` as source text for a message or a comparison; long or deep ones abbreviated.

    ast.unparse recurses once per level: a deep expression is named by its line.
    """
    text = unparsed(expr)
    if text is None:
        return f"<expression on line {getattr(expr, 'lineno', '?')}>"
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."
