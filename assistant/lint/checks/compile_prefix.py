"""A checkpoint of a torch.compile'd model loaded into one that is not compiled.

`model = torch.compile(model)` returns an OptimizedModule that holds the model as
`_orig_mod`, so its state_dict() names every tensor "_orig_mod.<name>"; under
`DDP(model)` the wrapper's `.module` is that compiled module. A checkpoint saved
from it (`torch.save(model.module.state_dict(), path)`) and loaded strictly into a
fresh model that is not compiled (the final test, an export, a resume before the
compile) fails on every key, after the whole training has run. torch-compile-ddp,
reported at the load.

And torch.compile of a model FSDP (FullyShardedDataParallel) wrapped without
use_orig_params=True: FSDP1 then hands Dynamo flattened FlatParameters, which it
does not trace ("TorchDynamo only supports FSDP with use_orig_params=True"), so
the distributed run fails where a one-GPU run compiles.

The save and the load are paired by their path's text, within one function.
Quiet when the load is not strict, goes into a compiled model, and wherever the
file names `_orig_mod` (saving `model.module._orig_mod.state_dict()`, or
stripping the prefix).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.collective_saves import FSDP_CLASS
from assistant.lint.checks.state_dict import strict_load
from assistant.lint.model import Script, keyword, short, source_text, walk
from assistant.lint.registry import check
from assistant.lint.torchapi import is_ddp, loaded_file
from assistant.results import Finding

COMPILED, WRAPS_COMPILED = "compiled", "DDP of a compiled model"
INNER = "_orig_mod"


@check("torch-compile-ddp")
def check_compiled_checkpoint_loaded_uncompiled(script: Script) -> Iterator[Finding]:
    """torch.save of a compiled model's state_dict, loaded strictly into a plain model."""
    if names_the_inner_module(script) or not any(is_ddp(name) for _node, name in script.call_names):
        return
    if not any(name == "torch.compile" for _node, name in script.call_names):
        return
    for scope in script.all_scopes:
        yield from compiled_saves_loaded_plain(script, scope)


def names_the_inner_module(script: Script) -> bool:
    """Code (not a docstring) that reads `._orig_mod` or handles "_orig_mod." keys."""
    parents = script.parents
    return any(
        (isinstance(node, ast.Attribute) and node.attr == INNER)
        or (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and INNER in node.value
            and not isinstance(parents.get(id(node)), ast.Expr)
        )
        for node in script.nodes
    )


def compiled_saves_loaded_plain(script: Script, scope: ast.AST) -> Iterator[Finding]:
    """Walks one scope's statements in line order, keeping what each name holds."""
    holds: dict[str, str | None] = {}
    saved: dict[str, int] = {}  # path text -> line of the compiled state_dict's save
    nodes = sorted(
        (n for n in script.scope_nodes(scope) if isinstance(n, (ast.Assign, ast.Call))),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for node in nodes:
        if isinstance(node, ast.Assign):
            kind = what_it_holds(script, node.value, holds)
            for target in node.targets:
                if isinstance(target, ast.Name):
                    holds[target.id] = kind
            continue
        if script.name_of(node.func) == "torch.save" and len(node.args) > 1:
            if any(is_compiled_state(n, holds) for n in walk(node.args[0])):
                saved[source_text(node.args[1])] = node.lineno
        elif is_plain_strict_load(node, holds) and saved:
            path = loaded_path(script, node, scope)
            if path in saved:
                target = source_text(node.func.value)
                yield script.finding(
                    "torch-compile-ddp",
                    node,
                    f"{target}.load_state_dict loads the checkpoint saved at line {saved[path]} "
                    "from a torch.compile'd model (its state_dict names every tensor "
                    f'"_orig_mod.<name>") into {target}, which is not compiled: the strict load '
                    "fails with Missing and Unexpected key(s) after the whole run; save the "
                    "inner module (`model.module._orig_mod.state_dict()`), or compile "
                    f"{target} too",
                )


def what_it_holds(script: Script, value: ast.expr, holds: dict[str, str | None]) -> str | None:
    """COMPILED for torch.compile(...), WRAPS_COMPILED for DDP(<a compiled name>)."""
    if not isinstance(value, ast.Call):
        return None
    name = script.name_of(value.func)
    if name == "torch.compile":
        return COMPILED
    module = value.args[0] if value.args else keyword(value, "module")
    if is_ddp(name) and isinstance(module, ast.Name) and holds.get(module.id) == COMPILED:
        return WRAPS_COMPILED
    return None


def is_compiled_state(node: ast.AST, holds: dict[str, str | None]) -> bool:
    """`model.state_dict()` of a compiled name, or `ddp.module.state_dict()` of a DDP over one."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "state_dict"
    ):
        return False
    owner = node.func.value
    if isinstance(owner, ast.Name):
        return holds.get(owner.id) == COMPILED
    return (
        isinstance(owner, ast.Attribute)
        and owner.attr == "module"
        and isinstance(owner.value, ast.Name)
        and holds.get(owner.value.id) == WRAPS_COMPILED
    )


def is_plain_strict_load(node: ast.Call, holds: dict[str, str | None]) -> bool:
    """`model.load_state_dict(...)` into a name that holds no compiled model, strictly."""
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == "load_state_dict"):
        return False
    owner = node.func.value
    return isinstance(owner, ast.Name) and holds.get(owner.id) is None and strict_load(node)


def loaded_path(script: Script, load: ast.Call, scope: ast.AST) -> str | None:
    """The path text of the torch.load whose result (or an entry of it) is loaded."""
    state = load.args[0] if load.args else keyword(load, "state_dict")
    while isinstance(state, ast.Subscript):  # ckpt["model"]
        state = state.value
    if isinstance(state, ast.Name):  # ckpt = torch.load(path) earlier in the scope
        values = [
            n.value
            for n in script.scope_nodes(scope)
            if isinstance(n, ast.Assign)
            and n.lineno < load.lineno
            and any(isinstance(t, ast.Name) and t.id == state.id for t in n.targets)
        ]
        state = values[-1] if values else None
    if isinstance(state, ast.Call) and script.name_of(state.func) == "torch.load":
        path = loaded_file(state)
        return None if path is None else source_text(path)
    return None


@check("torch-compile-ddp")
def check_compile_of_fsdp_without_original_parameters(script: Script) -> Iterator[Finding]:
    """`model = FSDP(model, ...)` without use_orig_params=True, then
    `torch.compile(model)` in the same function."""
    if not any(name == "torch.compile" for _node, name in script.call_names):
        return
    for scope in script.all_scopes:
        flat: dict[str, int] = {}  # names bound to an FSDP1 of flat parameters -> line
        nodes = sorted(
            (n for n in script.scope_nodes(scope) if isinstance(n, ast.Assign | ast.Call)),
            key=lambda n: (n.lineno, isinstance(n, ast.Assign), n.col_offset),
        )  # a call before the assignment it stands in: `model = torch.compile(model)`
        for node in nodes:
            if isinstance(node, ast.Call) and script.name_of(node.func) == "torch.compile":
                given = node.args[0] if node.args else keyword(node, "model")
                if isinstance(given, ast.Name) and given.id in flat:
                    yield compiled_flat_fsdp(script, node, given.id, flat[given.id])
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                flattens = short(script.name_of(node.value.func)) == FSDP_CLASS
                for target in (t for t in node.targets if isinstance(t, ast.Name)):
                    if flattens and not keeps_params(node.value):
                        flat[target.id] = node.lineno
                    else:
                        flat.pop(target.id, None)


def compiled_flat_fsdp(script: Script, call: ast.Call, name: str, wrapped: int) -> Finding:
    return script.finding(
        "torch-compile-ddp",
        call,
        f"torch.compile of {name}, wrapped by FSDP on line {wrapped} without "
        "use_orig_params=True: FSDP then holds flattened parameters, which Dynamo does not "
        'trace ("TorchDynamo only supports FSDP with use_orig_params=True"), so the '
        "distributed run fails; pass use_orig_params=True to FSDP",
    )


def keeps_params(fsdp: ast.Call) -> bool:
    """FSDP(..., use_orig_params=True), or a value the file does not fix."""
    given = keyword(fsdp, "use_orig_params")
    if given is None:
        return any(k.arg is None for k in fsdp.keywords)  # **options: unknown
    return not (isinstance(given, ast.Constant) and not given.value)
