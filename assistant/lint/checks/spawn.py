"""What mp.spawn is handed: its `args`, and the worker it calls (mp-spawn-arguments).

`torch.multiprocessing.spawn(fn, args=(...), nprocs=N)` (and
`start_processes`, the same first two parameters) runs `fn(i, *args)` in each
process: the process index comes first, then args unpacked with `*`. So:

- `args=(cfg)` is cfg itself, not a tuple (only a comma makes one): an int
  fails ("argument after * must be an iterable"), a dict or config object is
  unpacked into one positional argument per key ("takes 2 positional arguments
  but 63 were given");
- a tuple of n values needs a worker that takes n + 1 positional arguments,
  defaults and *args counted (`def main(rank, world_size)` with
  `args=(rank, world_size)` is given three);
- `mp.spawn(train(cfg), ...)` runs train once, in the parent, and hands
  spawn what it returns;
- values in another order than the worker's parameters, seen by name
  (`args=(args.config, world_size)` for `worker(rank, world_size,
  config_path)`) or by annotation (`args=(cfg, n_gpus)` for `worker(rank,
  world_size: int, cfg: Config)` with `cfg = Config(...)`), or by the process
  count (`args=(ngpus, opt)` with nprocs=ngpus for `worker(ngpus_per_node,
  gpu, opt)`: every process gets the count as its GPU).

Quiet when the worker is not a plain function of this file (a method, a
`functools.partial`, a decorated or redefined function, a name rebound where
the spawn reads it), when args is built elsewhere or unpacks `*rest`, and when a
parenthesised name is assigned a tuple or list somewhere in the file
(`args=(settings)` after `settings = (world_size, lr)` is fine).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.model import (
    Function,
    Script,
    called_name,
    is_int,
    keyword,
    parameter_names,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import enclosing_scope
from assistant.lint.registry import check
from assistant.lint.torchapi import LIGHTNING_HOOKED, lightning_classes
from assistant.results import Finding

SPAWN_CALLS = frozenset({"torch.multiprocessing.spawn", "torch.multiprocessing.start_processes"})
# Values that are never a sequence of arguments, whatever they hold.
NOT_A_SEQUENCE = (ast.Constant, ast.Dict, ast.Set, ast.JoinedStr, ast.DictComp, ast.SetComp)
# Values a pair of parentheses may wrap by mistake: a name, a field, an item.
PLAIN_VALUES = (ast.Name, ast.Attribute, ast.Subscript)
# Decorators that keep the function's signature (torchelastic's error recorder).
SIGNATURE_KEEPING_DECORATORS = frozenset({"record"})
# Parameter names of a process's own index (its GPU, its rank).
INDEX_NAME = re.compile(
    r"(?:local_)?(?:rank|gpu|gpu_id|gpu_idx|device_id|proc_id|process_id|index|idx)"
)
# Calls whose value is a whole number (a count of GPUs, of items).
NUMBER_BUILDERS = frozenset({"int", "len", "device_count"})


@check("mp-spawn-arguments")
def check_spawn_arguments(script: Script) -> Iterator[Finding]:
    """mp.spawn(fn, args=...) whose fn(i, *args) cannot be the call meant."""
    spawns = [node for node, name in script.call_names if name in SPAWN_CALLS]
    if not spawns:
        return
    workers = Workers(script)
    for node in spawns:
        worker = node.args[0] if node.args else keyword(node, "fn")
        if worker is None:
            continue
        if isinstance(worker, ast.Call):
            yield from called_worker(script, node, worker, workers)
            continue
        arguments, parenthesised = spawn_args(node)
        if arguments is not None and not_a_tuple(script, arguments, parenthesised):
            text = source_text(arguments)
            written = f"args=({text})" if parenthesised else f"args={text}"
            yield script.finding(
                "mp-spawn-arguments",
                node,
                f"{written} is {text + ' itself' if parenthesised else 'a single value'}, "
                f"not a tuple (only a comma makes one): spawn calls {source_text(worker)}(i, "
                f"*{text}), which fails on a number or unpacks a dict or config into one "
                f"argument per key; write args=({text},)",
            )
            continue
        yield from count_mismatch(script, node, worker, arguments, workers)


def spawn_args(call: ast.Call) -> tuple[ast.expr | None, bool]:
    """The `args` of a spawn call and whether it is wrapped in parentheses
    (`args=(cfg)`: the keyword ends after its value); (None, False) if absent."""
    if len(call.args) > 1:
        return call.args[1], False
    for item in call.keywords:
        if item.arg == "args":
            value = item.value
            wrapped = (item.end_lineno, item.end_col_offset) != (
                value.end_lineno,
                value.end_col_offset,
            )
            return value, wrapped
    return None, False


def not_a_tuple(script: Script, value: ast.expr, parenthesised: bool) -> bool:
    """A literal that is no sequence (`args=5`, `args={"lr": 1}`), or a plain name or
    field in parentheses (`args=(cfg)`) that the file never assigns a tuple or list."""
    if isinstance(value, NOT_A_SEQUENCE):
        return True
    if not (parenthesised and isinstance(value, PLAIN_VALUES)):
        return False
    if isinstance(value, ast.Subscript):
        # `args=(cfg["train"])`: one entry of a config, not a tuple of arguments
        key = value.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str)
    assigned = script.assigned_values.get(source_text(value), [])
    return not any(is_sequence(script, v) for v in assigned)


def is_sequence(script: Script, value: ast.expr) -> bool:
    """A tuple or list, written out or built by tuple(...) / list(...)."""
    if isinstance(value, (ast.Tuple, ast.List, ast.ListComp)):
        return True
    return isinstance(value, ast.Call) and script.name_of(value.func) in ("tuple", "list")


def called_worker(
    script: Script, spawn: ast.Call, worker: ast.Call, workers: Workers
) -> Iterator[Finding]:
    """`mp.spawn(train(cfg), ...)`: a worker of this file called in the parent
    (one that returns nothing, so not a factory of workers)."""
    function = workers.plain_function(worker.func)
    if function is None or workers.returns_a_value(function):
        return
    target = source_text(worker.func)
    yield script.finding(
        "mp-spawn-arguments",
        spawn,
        f"mp.spawn({source_text(worker)}, ...) calls {target} here, once, in the parent "
        f"process, and hands spawn its result (None) as the worker; pass the function "
        f"itself: mp.spawn({target}, args=(...), nprocs=N), which calls {target}(i, *args) "
        "in each process",
    )


def count_mismatch(
    script: Script,
    spawn: ast.Call,
    worker: ast.expr,
    arguments: ast.expr | None,
    workers: Workers,
) -> Iterator[Finding]:
    """A tuple of n values (none: the default `()`) for a worker of this file that
    cannot take n + 1 positional arguments."""
    if arguments is None:
        values: list[ast.expr] = []
    elif isinstance(arguments, (ast.Tuple, ast.List)):
        values = arguments.elts
    else:
        return
    if any(isinstance(v, ast.Starred) for v in values):
        return
    function = workers.plain_function(worker)
    if function is None:
        return
    given = len(values) + 1
    parameters = function.args.posonlyargs + function.args.args
    required = len(parameters) - len(function.args.defaults)
    takes_more = function.args.vararg is not None
    keyword_only = [
        p.arg
        for p, default in zip(function.args.kwonlyargs, function.args.kw_defaults, strict=True)
        if default is None
    ]
    name = function.name
    shown = f"args=({', '.join(source_text(v) for v in values)}{',' if len(values) == 1 else ''})"
    if given < required or (given > len(parameters) and not takes_more):
        wanted = [p.arg for p in parameters]
        yield script.finding(
            "mp-spawn-arguments",
            spawn,
            f"spawn calls {name}(i, *args) with the process index first, so {shown} gives "
            f"{name} {given} positional argument{'s' if given != 1 else ''} but it takes "
            f"{describe_count(required, len(parameters), takes_more)} ({', '.join(wanted)}): "
            f"TypeError in every process; give {name} the process index as its first "
            "parameter and pass only the others in args (not the rank)",
        )
    elif misplaced := misplaced_argument(script, spawn, parameters, values):
        value, slot, why, index_named = misplaced
        yield script.finding(
            "mp-spawn-arguments",
            spawn,
            f"spawn calls {name}(i, *args), so {shown} hands {source_text(value)} to "
            f"{name}'s parameter {slot} (the process index fills the first one, "
            f"{parameters[0].arg}), {why}: the arguments arrive in the wrong parameters; "
            + (
                f"give {name} the process index as its first parameter"
                if index_named
                else f"put args in the order of {name}'s parameters after the first"
            ),
        )
    elif keyword_only:
        yield script.finding(
            "mp-spawn-arguments",
            spawn,
            f"spawn passes args to {name} by position only, so its keyword-only "
            f"parameter{'s' if len(keyword_only) > 1 else ''} without a default "
            f"({', '.join(keyword_only)}) never {'get' if len(keyword_only) > 1 else 'gets'} a "
            "value (TypeError in every process); "
            f"make {'them' if len(keyword_only) > 1 else 'it'} positional and pass "
            f"{'them' if len(keyword_only) > 1 else 'it'} in args",
        )


def misplaced_argument(
    script: Script, spawn: ast.Call, parameters: list[ast.arg], values: list[ast.expr]
) -> tuple[ast.expr, str, str, bool] | None:
    """A value of args that lands in a parameter not meant for it, told by its
    name, its kind against an annotation, or its being the process count:
    (the value, the parameter, why, whether the value is named like the first
    parameter: the worker then lacks one for the process index)."""
    if swapped := swapped_argument(parameters, values):
        value, slot, own = swapped
        why = f"while the worker has a parameter {own} of its own"
        return value, slot, why, own == parameters[0].arg
    found = mistyped_argument(script, parameters, values) or count_in_an_index(
        spawn, parameters, values
    )
    return (*found, False) if found else None


def swapped_argument(
    parameters: list[ast.arg], values: list[ast.expr]
) -> tuple[ast.expr, str, str] | None:
    """A value in args named exactly like one of the worker's parameters but
    landing in another (`args=(args.config, world_size)` for
    `worker(rank, world_size, config_path)`; `args=(cfg,)` for
    `worker(cfg, rank)`, whose first parameter spawn fills with the index).
    Only names that match exactly count, but for case: a module's constant
    `CFG` handed to `worker(rank, cfg, world_size)` is the config it means."""
    names = [p.arg for p in parameters]
    folded = [name.lower() for name in names]
    for position, value in enumerate(values, start=1):
        own = value_name(value)
        if own is None or position >= len(names) or folded[position] == own.lower():
            continue
        if own.lower() in folded:
            return value, names[position], names[folded.index(own.lower())]
    return None


def count_in_an_index(
    spawn: ast.Call, parameters: list[ast.arg], values: list[ast.expr]
) -> tuple[ast.expr, str, str] | None:
    """The process count given as spawn's nprocs, also in args, landing in a
    parameter named like a process's own index (`args=(ngpus, opt)` for
    `worker(ngpus_per_node, gpu, opt)`): (the value, the parameter, why)."""
    nprocs = keyword(spawn, "nprocs") or (spawn.args[2] if len(spawn.args) > 2 else None)
    if nprocs is None:
        return None
    count = source_text(nprocs)
    for position, value in enumerate(values, start=1):
        if (
            position < len(parameters)
            and source_text(value) == count
            and INDEX_NAME.fullmatch(parameters[position].arg)
        ):
            return (
                value,
                parameters[position].arg,
                "a process's own index given the number of processes (nprocs), the same in all",
            )
    return None


def mistyped_argument(
    script: Script, parameters: list[ast.arg], values: list[ast.expr]
) -> tuple[ast.expr, str, str] | None:
    """A value in args whose kind the file shows (a number: a literal, len(),
    int(), device_count(); an object of one of its classes: `Config(...)`),
    landing in a parameter annotated as the other kind (`world_size: int` given
    the config, `cfg: Config` given the GPU count): (the value, the parameter,
    its annotation, the value's kind). Quiet on any annotation or value it
    cannot tell."""
    classes = {node.name for node in script.tree.body if isinstance(node, ast.ClassDef)}
    for position, value in enumerate(values, start=1):
        if position >= len(parameters):
            break
        annotation = parameters[position].annotation
        wanted = annotation.id if isinstance(annotation, ast.Name) else None
        if wanted != "int" and wanted not in classes:
            continue
        kind = value_kind(script, value, classes)
        if kind is not None and kind != wanted:
            shown = "a number" if kind == "int" else f"an object of {kind}"
            return value, parameters[position].arg, f"annotated {wanted} but given {shown}"
    return None


def value_kind(script: Script, value: ast.expr, classes: set[str]) -> str | None:
    """ "int" or the file's class a value is visibly built as; a name counts when
    every assignment in the file builds the same kind."""
    built = script.assigned_values.get(value.id, []) if isinstance(value, ast.Name) else [value]
    kinds = {built_kind(v, classes) for v in built}
    return kinds.pop() if len(kinds) == 1 else None


def built_kind(value: ast.expr, classes: set[str]) -> str | None:
    if is_int(value):
        return "int"
    if not isinstance(value, ast.Call):
        return None
    if called_name(value) in NUMBER_BUILDERS:
        return "int"
    return value.func.id if isinstance(value.func, ast.Name) and value.func.id in classes else None


def value_name(value: ast.expr) -> str | None:
    """The name a value goes by: `world_size`, or the field of `args.world_size`."""
    if isinstance(value, ast.Name):
        return value.id
    if isinstance(value, ast.Attribute):
        return value.attr
    return None


def describe_count(required: int, total: int, takes_more: bool) -> str:
    if takes_more:
        return f"at least {required}"
    if required == total:
        return str(total)
    return f"{required} to {total}"


class Workers:
    """What the file's functions are, as spawn workers: worked out once per file."""

    def __init__(self, script: Script):
        self.script = script
        self.rebound: dict[int, frozenset[str]] = {}
        self.factories: dict[str, bool] = {}

    def plain_function(self, expr: ast.expr) -> Function | None:
        """The top-level function `expr` names, when that name means nothing else where
        `expr` reads it (rebound_names) and it is undecorated, or decorated only with
        a signature-keeping decorator."""
        script = self.script
        if not isinstance(expr, ast.Name) or expr.id not in script.functions:
            return None
        scope = enclosing_scope(expr, script)
        if scope is None or expr.id in self.rebound_where(scope):
            return None
        function = script.functions[expr.id]
        if any(short(script.name_of(d.func if isinstance(d, ast.Call) else d))
               not in SIGNATURE_KEEPING_DECORATORS for d in function.decorator_list):  # fmt: skip
            return None
        return function

    def returns_a_value(self, function: Function) -> bool:
        """The function returns something (a factory that builds the worker)."""
        if function.name not in self.factories:
            self.factories[function.name] = any(
                isinstance(node, ast.Return)
                and node.value is not None
                and not (isinstance(node.value, ast.Constant) and node.value.value is None)
                for node in self.script.scope_nodes(function)
            )
        return self.factories[function.name]

    def rebound_where(self, scope: ast.AST) -> frozenset[str]:
        if id(scope) not in self.rebound:
            self.rebound[id(scope)] = rebound_names(self.script, scope)
        return self.rebound[id(scope)]


def rebound_names(script: Script, scope: ast.AST) -> frozenset[str]:
    """Names that may mean something else, read in `scope`, than the file's one
    top-level `def` of them: the parameters and the assignment and loop targets of
    the scope and the functions around it and of the module (another function's
    `train=False` is its own), imports, and names defined more than once at the top
    level (by `def` or `class`)."""
    scopes = [script.tree]  # the module's names, then each function around `scope`
    while scope is not None and scope is not script.tree:
        scopes.append(scope)
        scope = enclosing_scope(scope, script)  # None past a class: its methods' own end
    names = {
        n.id
        for each in scopes
        for n in script.scope_nodes(each)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    names |= {name for each in scopes for name in parameter_names(each)}
    defined: set[str] = set()
    for node in script.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in defined:
                names.add(node.name)
            defined.add(node.name)
    return frozenset(names | set(script.aliases))


# What pickle cannot send to a spawned process: a lambda, a function defined
# inside another function.
SPAWN_STRATEGY = re.compile(r"spawn", re.IGNORECASE)


@check("spawn-pickle-error")
def check_unpicklable_field_sent_to_spawned_processes(script: Script) -> Iterator[Finding]:
    """`self.collate = lambda rows: ...` in a LightningModule or DataModule that
    a Trainer(strategy="ddp_spawn") sends to new processes, or in an object of the
    file's own class handed to mp.spawn's args: pickle cannot send it ("Can't
    pickle <function <lambda>>", "Can't pickle local object")."""
    spawned = spawned_classes(script)
    for cls in (n for n in script.of_type(ast.ClassDef) if n.name in spawned):
        for field, node in unpicklable_fields(cls):
            yield script.finding(
                "spawn-pickle-error",
                node,
                f"self.{field} holds a lambda or a function defined inside a method, and "
                f"{spawned[cls.name]} pickles this {cls.name} to send it to each new process: "
                "pickle cannot send it, and the start fails with \"Can't pickle <function "
                '<lambda>>" (or "Can\'t pickle local object"); use a function defined at '
                'module level (functools.partial of it for the arguments), or strategy="ddp"',
            )


def spawned_classes(script: Script) -> dict[str, str]:
    """The file's classes whose objects a spawn start pickles, with who does it:
    Lightning's modules under a spawn strategy, the classes built into mp.spawn's args."""
    found: dict[str, str] = {}
    spawn_strategy = any(
        short(name) == "Trainer"
        and isinstance(strategy := keyword(node, "strategy"), ast.Constant)
        and isinstance(strategy.value, str)
        and SPAWN_STRATEGY.search(strategy.value)
        for node, name in script.call_names
    )
    for cls in lightning_classes(script, LIGHTNING_HOOKED) if spawn_strategy else []:
        found[cls.name] = 'the Trainer\'s spawn strategy ("ddp_spawn")'
    for node, name in script.call_names:
        if name not in SPAWN_CALLS:
            continue
        args, _ = spawn_args(node)
        for value in walk(args) if args is not None else ():
            values = [value]
            if isinstance(value, ast.Name):
                values += script.assigned_values.get(value.id, [])
            for made in values:
                if isinstance(made, ast.Call) and isinstance(made.func, ast.Name):
                    found.setdefault(made.func.id, "mp.spawn")
    return found


def unpicklable_fields(cls: ast.ClassDef) -> Iterator[tuple[str, ast.Assign]]:
    """`self.x = lambda ...`, or `self.x = inner` for a function defined in the method."""
    for method in (m for m in cls.body if isinstance(m, ast.FunctionDef)):
        local = {n.name for n in walk(method) if isinstance(n, ast.FunctionDef) and n is not method}
        for node in walk(method):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target = node.targets[0]
            if not (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                continue
            value = node.value
            if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in local):
                yield target.attr, node
