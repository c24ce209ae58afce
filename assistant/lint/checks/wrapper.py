"""The model's own attributes read through the DDP wrapper (ddp-wrapper-attribute).

`model = DistributedDataParallel(model)` rebinds the name to a wrapper that is
an nn.Module of its own: it has the Module API, DDP's few attributes and the
wrapped model as `.module`, nothing else. `model.generate(...)`,
`model.config`, `model.loss_fn(...)` then raise AttributeError on every rank
(the same for nn.DataParallel). FSDP is left alone: it forwards unknown
attributes to the wrapped module.

The Hugging Face Trainer wraps the model out of sight: under torchrun or
`accelerate launch` its hooks (compute_loss, training_step, prediction_step)
get the DDP wrapper as `model`, and nn.DataParallel when one process sees
several GPUs; `model.config` there fails the same way, only with more than
one GPU.

Quiet where the script may know better: an attribute the script sets on the
wrapper itself, one it looks up by name (`hasattr(model, "generate")`,
`getattr(model, "config", None)`), and a name rebound to something else
before the read.
"""

from __future__ import annotations

import ast
import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from assistant.lint.checks.unused import forward_of, model_classes
from assistant.lint.model import (
    Script,
    bound_arguments,
    parameter_names,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import enclosing_scope
from assistant.lint.registry import check
from assistant.lint.torchapi import imports_package
from assistant.results import Finding

# nn.Module's public API (torch 2.x): what every wrapper has; smart_apply is
# added to nn.Module by transformers when it is imported.
MODULE_API = frozenset(
    {
        "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init",
        "children", "compile", "cpu", "cuda", "double", "dump_patches", "eval",
        "extra_repr", "float", "forward", "get_buffer", "get_extra_state",
        "get_parameter", "get_submodule", "half", "ipu", "load_state_dict", "modules",
        "mtia", "named_buffers", "named_children", "named_modules", "named_parameters",
        "parameters", "register_backward_hook", "register_buffer", "register_forward_hook",
        "register_forward_pre_hook", "register_full_backward_hook",
        "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
        "register_load_state_dict_pre_hook", "register_module", "register_parameter",
        "register_state_dict_post_hook", "register_state_dict_pre_hook", "requires_grad_",
        "set_extra_state", "set_submodule", "share_memory", "state_dict", "to", "to_empty",
        "train", "training", "type", "xpu", "zero_grad", "smart_apply",
    }
)  # fmt: skip
# DistributedDataParallel's own, class and instance (torch 1.x and 2.x).
DDP_API = frozenset(
    {
        "module", "no_sync", "join", "join_device", "join_hook", "join_process_group",
        "register_comm_hook", "gather", "scatter", "to_kwargs", "will_sync_module_buffers",
        "batched_grad_copy", "broadcast_bucket_size", "broadcast_buffers", "bucket_bytes_cap",
        "bucket_bytes_cap_default", "bucket_bytes_cap_list", "device", "device_ids",
        "device_type", "dim", "find_unused_parameters", "forward_sync_buffers",
        "gradient_as_bucket_view", "is_multi_device_module", "logger", "mixed_precision",
        "modules_buffers", "named_module_buffers", "output_device", "parameters_to_ignore",
        "process_group", "reducer", "require_backward_grad_sync", "require_forward_param_sync",
        "skip_all_reduce_unused_params", "static_graph", "use_side_stream_for_tensor_copies",
        "ddp_uneven_inputs_config", "gradient_predivide_factor", "sync_bn",
    }
)  # fmt: skip
DATA_PARALLEL_API = frozenset(
    {"module", "device_ids", "output_device", "dim", "src_device_obj", "gather", "scatter",
     "replicate", "parallel_apply"}
)  # fmt: skip
# What a Trainer hook's `model` holds with more than one GPU: either wrapper.
TRAINER_WRAPPED = "Trainer's wrapped model"
WRAPPERS = {
    "DistributedDataParallel": MODULE_API | DDP_API,
    "DataParallel": MODULE_API | DATA_PARALLEL_API,
    TRAINER_WRAPPED: MODULE_API | DDP_API | DATA_PARALLEL_API,
}


@dataclass
class Bindings:
    """Where one name is bound in a scope, in line order, and to a wrapper or not."""

    lines: list[int] = field(default_factory=list)
    wrappers: list[str | None] = field(default_factory=list)  # the wrapper's class, or None

    def add(self, line: int, wrapper: str | None) -> None:
        at = bisect.bisect_right(self.lines, line)
        self.lines.insert(at, line)
        self.wrappers.insert(at, wrapper)

    def wrapper_at(self, line: int) -> str | None:
        """The wrapper the name holds when `line` runs (the last binding above it)."""
        at = bisect.bisect_left(self.lines, line) - 1
        return self.wrappers[at] if at >= 0 else None


# Packages whose Trainer hands its hooks the wrapped model, and those hooks.
TRAINER_PACKAGES = frozenset({"transformers", "trl"})
TRAINER_HOOKS = frozenset({"compute_loss", "training_step", "prediction_step"})


@check("ddp-wrapper-attribute")
def check_wrapper_attribute(script: Script) -> Iterator[Finding]:
    """`model.generate()` after `model = DDP(model)`: the wrapper has no such attribute."""
    hooks = trainer_hooks(script)
    if not hooks and not any(
        short(name) in WRAPPERS or is_prepare(node) for node, name in script.call_names
    ):
        return
    guarded = attributes_probed(script)
    scopes = {
        id(scope): ScopeFacts(script, script.scope_nodes(scope)) for scope in script.all_scopes
    }
    bind_wrapped_parameters(script, scopes)
    bind_closures(script, scopes)
    for hook in hooks:
        model = hook.args.args[1]  # after self: the model the Trainer passes
        scopes[id(hook)].bind(model.arg, hook.lineno, TRAINER_WRAPPED)
    flags = model_flags(script)
    for facts in scopes.values():
        yield from facts.wrapper_reads(script, guarded)
        yield from facts.wrapper_probes(script)
        for node in facts.stores:
            wrapper = facts.wrapper_at(node.value.id, node.lineno)
            if wrapper in WRAPPERS and node.attr in flags - WRAPPERS[wrapper]:
                yield flag_set_on_the_wrapper(script, node, node.value.id, wrapper)
    for cls in (node for node in script.tree.body if isinstance(node, ast.ClassDef)):
        yield from wrapper_fields(script, cls, guarded, flags)


class ScopeFacts:
    """In one scope (in source order): where each name is bound and to what, the
    attributes the script sets on names itself, and the attribute reads."""

    def __init__(self, script: Script, nodes: list[ast.AST]):
        self.bindings: dict[str, Bindings] = {}
        self.set_on: set[tuple[str, str]] = set()  # (name, attribute) the script assigns
        self.reads: list[ast.Attribute] = []
        self.stores: list[ast.Attribute] = []  # `name.attr = ...`, in source order
        self.probes: list[ast.Call] = []  # `hasattr(name, "attr")`, `getattr(name, "attr", d)`
        # a parameter some calls pass the wrapper and others the bare model: the calls
        # that pass the wrapper
        self.passed_by: dict[str, list[ast.Call]] = {}
        # names the scope tests for a wrapper (`isinstance(m, DDP)`, `hasattr(m, "module")`):
        # it reads them one way or the other as they are
        self.unwrapped_here: set[str] = set()
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for name, wrapper in bound_wrappers(script, node):
                    self.bind(name, node.lineno, wrapper)
            elif isinstance(
                node, (ast.AugAssign, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.NamedExpr)
            ):
                for target in binding_targets(node):
                    for name in plain_names(target):
                        self.bind(name, node.lineno, None)
            elif isinstance(node, ast.Call) and probed_attribute(script, node):
                self.probes.append(node)
                if node.args[1].value == "module":  # `hasattr(m, "module")`: unwraps itself
                    self.unwrapped_here.add(node.args[0].id)
            elif isinstance(node, ast.Call) and (tested := wrapper_type_test(script, node)):
                self.unwrapped_here.add(tested)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    self.reads.append(node)
                else:
                    self.set_on.add((node.value.id, node.attr))
                    self.stores.append(node)

    def bind(self, name: str, line: int, wrapper: str | None) -> None:
        self.bindings.setdefault(name, Bindings()).add(line, wrapper)

    def wrapper_at(self, name: str, line: int) -> str | None:
        return self.bindings[name].wrapper_at(line) if name in self.bindings else None

    def wrapper_reads(self, script: Script, guarded: frozenset[str]) -> Iterator[Finding]:
        """Each `name.attr` read while `name` holds a wrapper."""
        for node in self.reads:
            name, attribute = node.value.id, node.attr
            if attribute.startswith("_") or attribute in guarded:
                continue
            wrapper = self.wrapper_at(name, node.lineno)
            if (
                wrapper is None
                or attribute in WRAPPERS[wrapper]
                or (name, attribute) in self.set_on
                or name in self.unwrapped_here
            ):
                continue
            if wrapper == TRAINER_WRAPPED:
                yield script.finding(
                    "ddp-wrapper-attribute",
                    node,
                    f"{name}.{attribute}: with more than one GPU the Trainer passes this hook "
                    f"the wrapped model (DistributedDataParallel under torchrun or accelerate "
                    f"launch, DataParallel in one process), which has no attribute "
                    f"{attribute!r}: AttributeError on the first step, though one GPU works; "
                    f"read self.model.{attribute} (the Trainer keeps the unwrapped model "
                    "there)",
                )
                continue
            if name in self.passed_by:
                calls = self.passed_by[name]
                fallback = fallback_parameter(script, node)
                if fallback is not None and all(
                    fallback in given_parameters(script, call) for call in calls
                ):
                    continue  # `fn = fn or model.attr`: each wrapper's call gives fn
                line = calls[0].lineno
                yield script.finding(
                    "ddp-wrapper-attribute",
                    node,
                    f"{name}.{attribute}: the call on line {line} passes the {wrapper} wrapper "
                    f"as {name} (other calls pass the bare model), and the wrapper has no "
                    f"attribute {attribute!r}: AttributeError on every rank at that call; "
                    "pass the unwrapped model there (.module)",
                )
                continue
            yield script.finding(
                "ddp-wrapper-attribute",
                node,
                f"{name}.{attribute}: {name} is the {wrapper} wrapper here, which has no "
                f"attribute {attribute!r} (AttributeError on every rank); use "
                f"{name}.module.{attribute}, or keep a name for the unwrapped model"
                + (
                    f" (accelerator.unwrap_model({name}).{attribute})"
                    if imports_package(script, "accelerate")
                    else ""
                ),
            )

    def wrapper_probes(self, script: Script) -> Iterator[Finding]:
        """Each probe of a model's attribute by string while the name holds a wrapper:
        hasattr is False, getattr gives its default, whatever the model defines."""
        for node in self.probes:
            name, attribute = node.args[0].id, node.args[1].value
            wrapper = self.wrapper_at(name, node.lineno)
            if (
                wrapper in (None, TRAINER_WRAPPED)  # a hook gets either: probing is handling
                or attribute.startswith("_")
                or attribute in WRAPPERS[wrapper]
                or (name, attribute) in self.set_on
            ):
                continue
            outcome = (
                "is False"
                if short(script.name_of(node.func)) == "hasattr"
                else ("returns its default")
            )
            yield script.finding(
                "ddp-wrapper-attribute",
                node,
                f"{source_text(node)} {outcome} here on every GPU run: {name} is the {wrapper} "
                f"wrapper, which has no attribute {attribute!r}, so what the model defines "
                f"under that name is silently skipped (one GPU, unwrapped, uses it); probe "
                f"{name}.module, or pass the unwrapped model",
            )


def wrapper_type_test(script: Script, node: ast.Call) -> str | None:
    """The name in `isinstance(name, DDP)` (or a tuple of types naming a wrapper)."""
    if script.name_of(node.func) != "isinstance" or len(node.args) != 2:
        return None
    tested, kinds = node.args
    named = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
    if isinstance(tested, ast.Name) and any(
        short(script.name_of(kind)) in WRAPPERS for kind in named
    ):
        return tested.id
    return None


def probed_attribute(script: Script, node: ast.Call) -> bool:
    """`hasattr(name, "attr")` or `getattr(name, "attr", default)`."""
    called = script.name_of(node.func)
    arity = {"hasattr": 2, "getattr": 3}.get(called)
    return (
        arity is not None
        and len(node.args) == arity
        and isinstance(node.args[0], ast.Name)
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def trainer_hooks(script: Script) -> list[ast.FunctionDef]:
    """compute_loss / training_step / prediction_step of a Hugging Face Trainer
    subclass, which the Trainer calls with the wrapped model as their `model`."""
    hooks = []
    for cls in (node for node in script.tree.body if isinstance(node, ast.ClassDef)):
        if not any(
            script.name_of(base).split(".")[0] in TRAINER_PACKAGES
            and short(script.name_of(base)).endswith("Trainer")
            for base in cls.bases
        ):
            continue
        hooks += [
            method
            for method in cls.body
            if isinstance(method, ast.FunctionDef)
            and method.name in TRAINER_HOOKS
            and len(method.args.args) > 1
        ]
    return hooks


# How many calls deep a wrapper is followed into the file's functions
# (`meta_eval(model)` -> `episode_logits(model)` -> ...).
WRAPPER_CALL_DEPTH = 4


def bind_wrapped_parameters(script: Script, scopes: dict[int, ScopeFacts]) -> None:
    """A function's parameter holds the wrapper when every call of the function in
    the file passes it a name that holds the same wrapper there (`evaluate(model)`
    after `model = DDP(model)`), and so on into what that function calls with it;
    a method's too, called on an instance of its class (`ckpt.save(model)` after
    `ckpt = CheckpointManager(...)`)."""
    bound: set[tuple[str, int]] = set()
    for _ in range(WRAPPER_CALL_DEPTH):
        passed = wrappers_passed(script, scopes)
        newly = False
        for (function_name, position), wrappers in passed.items():
            function = script.functions[function_name]
            parameters = function.args.posonlyargs + function.args.args
            kinds = set(wrappers) - {None}
            if (function_name, position) in bound or len(kinds) != 1 or position >= len(parameters):
                continue
            facts = scopes.get(id(function))
            if facts is not None:
                wrapper = next(iter(kinds))
                name = parameters[position].arg
                facts.bind(name, function.lineno, wrapper)
                if None in wrappers:  # other calls pass the bare model: say which one fails
                    facts.passed_by[name] = wrappers[wrapper]
                bound.add((function_name, position))
                newly = True
        if not newly:
            return


def wrappers_passed(
    script: Script, scopes: dict[int, ScopeFacts]
) -> dict[tuple[str, int], dict[str | None, list[ast.Call]]]:
    """(function, position) -> the wrappers (None: not one) its calls pass there,
    each with the calls that pass it, in source order."""
    passed: dict[tuple[str, int], dict[str | None, list[ast.Call]]] = {}
    for scope in script.all_scopes:
        facts = scopes[id(scope)]
        for node in script.scope_nodes(scope):
            if not isinstance(node, ast.Call):
                continue
            called = called_function(script, node)
            if called is None:
                continue
            function_name, first = called
            for position, arg in enumerate(node.args, start=first):
                if isinstance(arg, ast.Name):
                    wrapper = facts.wrapper_at(arg.id, node.lineno)
                    passed.setdefault((function_name, position), {}).setdefault(wrapper, []).append(
                        node
                    )
    return passed


def fallback_parameter(script: Script, read: ast.Attribute) -> str | None:
    """p in `p or model.attr` (the read in a later operand of an `or` whose first is a
    plain name): the read runs only where p is empty."""
    child, parent = read, script.parents.get(id(read))
    while parent is not None and not isinstance(parent, ast.stmt):
        if (
            isinstance(parent, ast.BoolOp)
            and isinstance(parent.op, ast.Or)
            and isinstance(parent.values[0], ast.Name)
            and child is not parent.values[0]
        ):
            return parent.values[0].id
        child, parent = parent, script.parents.get(id(parent))
    return None


def given_parameters(script: Script, call: ast.Call) -> frozenset[str]:
    """The parameters a call of the file's function gives a value other than None."""
    called = called_function(script, call)
    if called is None:
        return frozenset()
    name, first = called
    return frozenset(
        parameter
        for parameter, argument in bound_arguments(
            script.functions[name], call, self_bound=first == 1
        )
        if parameter is not None
        and not (isinstance(argument, ast.Constant) and argument.value is None)
    )


def bind_closures(script: Script, scopes: dict[int, ScopeFacts]) -> None:
    """A nested function's free name holds the wrapper when every call of the function
    in its enclosing function comes where that name holds the same wrapper
    (`def evaluate(): model.generate(...)` called after `model = DDP(model)`).

    A function handed on as a callback (`estimator.update(occ_eval_fn=occ_eval_fn)`)
    runs at some later time: its name holds the wrapper when it does where the
    name holds the same wrapper at the hand-over and from there to the end of
    the enclosing function (no later rebinding can give it the bare model)."""
    for inner in script.all_scopes:
        if not isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        outer = enclosing_scope(inner, script)
        if not isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls, handed = uses_of_function(script.scope_nodes(outer), inner.name)
        inner_facts, outer_facts = scopes[id(inner)], scopes[id(outer)]
        read = {node.value.id for node in inner_facts.reads}
        free = read - parameter_names(inner) - set(inner_facts.bindings)
        end = outer.end_lineno or outer.lineno
        for name in free:
            held = {outer_facts.wrapper_at(name, line) for line in calls}
            held |= {outer_facts.wrapper_at(name, line) for line in handed}
            if handed:
                held.add(outer_facts.wrapper_at(name, end + 1))
            if len(held) == 1 and None not in held:
                inner_facts.bind(name, inner.lineno, next(iter(held)))


def uses_of_function(nodes: list[ast.AST], name: str) -> tuple[list[int], list[int]]:
    """The lines where a scope calls the function `name` (`name(...)`) and where it
    hands it to a call as an argument (`f(name)`, `f(callback=name)`)."""
    calls: list[int] = []
    handed: list[int] = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == name:
            calls.append(node.lineno)
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        if any(isinstance(arg, ast.Name) and arg.id == name for arg in arguments):
            handed.append(node.lineno)
    return calls, handed


def called_function(script: Script, call: ast.Call) -> tuple[str, int] | None:
    """The file's function a call runs, and which parameter its first argument
    fills: `f(x)` (0), `Cls(x)` for the file's class with an __init__ (1, after
    self), `obj.m(x)` where every `obj = ...` of the file builds the file's class
    that defines m (1, after self; 0 for a staticmethod)."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in script.functions:
            return func.id, 0
        # `ComputeLoss(model)`: the file's class, its __init__ after self
        return (f"{func.id}.__init__", 1) if f"{func.id}.__init__" in script.functions else None
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return None
    built = script.assigned_values.get(func.value.id, [])
    classes = {v.func.id for v in built if isinstance(v, ast.Call) and isinstance(v.func, ast.Name)}
    if len(classes) != 1 or len(built) != sum(isinstance(v, ast.Call) for v in built):
        return None
    method = f"{next(iter(classes))}.{func.attr}"
    if method not in script.functions:
        return None
    static = any(
        isinstance(d, ast.Name) and d.id == "staticmethod"
        for d in script.functions[method].decorator_list
    )
    return method, 0 if static else 1


def model_flags(script: Script) -> frozenset[str]:
    """Attributes the file's models read in their own forward (`if self.do_ds:`):
    set on a wrapper, such a flag never reaches the model."""
    return frozenset(
        node.attr
        for cls in model_classes(script)
        for node in walk(forward_of(cls))
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def flag_set_on_the_wrapper(
    script: Script, node: ast.Attribute, held: str, wrapper: str
) -> Finding:
    """`model.do_ds = False` where model is the wrapper and the model's forward reads self.do_ds."""
    return script.finding(
        "ddp-wrapper-attribute",
        node,
        f"{held}.{node.attr} = ...: {held} is the {wrapper} wrapper here, so this sets a new "
        f"attribute on the wrapper; the wrapped model's forward reads its own "
        f"self.{node.attr}, which keeps its old value; set {held}.module.{node.attr}",
    )


def wrapper_fields(
    script: Script, cls: ast.ClassDef, guarded: frozenset[str], flags: frozenset[str] = frozenset()
) -> Iterator[Finding]:
    """`self.model.generate()` in a class whose every `self.model = ...` is a wrapper.

    Methods run in an order the file does not show, so a field is judged only
    when nothing but a wrapper is ever assigned to it.
    """
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes = [node for method in methods for node in script.scope_nodes(method)]
    kinds: dict[str, set[str | None]] = {}
    set_on: set[tuple[str, str]] = set()
    for node in nodes:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if field := self_attribute(target):
                    kinds.setdefault(field, set()).add(wrapper_of(script, node.value))
        elif (
            isinstance(node, ast.Attribute)
            and not isinstance(node.ctx, ast.Load)
            and (field := self_attribute(node.value))
        ):
            set_on.add((field, node.attr))
    wrapped = {f: next(iter(k)) for f, k in kinds.items() if len(k) == 1 and None not in k}
    for node in nodes:
        field = self_attribute(node.value) if isinstance(node, ast.Attribute) else None
        stored = field in wrapped and not isinstance(node.ctx, ast.Load)
        if stored and node.attr in flags - WRAPPERS[wrapped[field]]:
            yield flag_set_on_the_wrapper(script, node, f"self.{field}", wrapped[field])
    for node in nodes:
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
            continue
        field = self_attribute(node.value)
        if field not in wrapped or node.attr.startswith("_") or node.attr in guarded:
            continue
        wrapper = wrapped[field]
        if node.attr in WRAPPERS[wrapper] or (field, node.attr) in set_on:
            continue
        yield script.finding(
            "ddp-wrapper-attribute",
            node,
            f"self.{field}.{node.attr}: self.{field} is only ever the {wrapper} wrapper, which "
            f"has no attribute {node.attr!r} (AttributeError on every rank); use "
            f"self.{field}.module.{node.attr}",
        )


def attributes_probed(script: Script) -> frozenset[str]:
    """Attribute names the script looks up by string: `hasattr(model, "generate")`,
    `getattr(model, "config", None)`; such a script handles the wrapper itself."""
    return frozenset(
        node.args[1].value
        for node, name in script.call_names
        if name in ("hasattr", "getattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def bound_wrappers(
    script: Script, node: ast.Assign | ast.AnnAssign
) -> list[tuple[str, str | None]]:
    """(name, wrapper or None) for each plain name an assignment binds. Accelerate's
    `model, optimizer = accelerator.prepare(model, optimizer)` wraps the module
    among them in DistributedDataParallel when several processes run."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    value = node.value
    if isinstance(value, ast.Call) and is_prepare(value):
        pairs = []
        for target in targets:
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            if len(elements) != len(value.args):
                pairs += [(name, None) for name in plain_names(target)]
                continue
            for element, arg in zip(elements, value.args, strict=True):
                wrapper = "DistributedDataParallel" if is_module(script, arg) else None
                pairs += [(name, wrapper) for name in plain_names(element)]
        return pairs
    wrapper = wrapper_of(script, value) if value is not None else None
    return [(name, wrapper) for target in targets for name in plain_names(target)]


def is_prepare(node: ast.Call) -> bool:
    """`accelerator.prepare(...)` (an object named like an accelerator)."""
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in ("prepare", "prepare_model")
        and isinstance(func.value, ast.Name)
        and "accelerator" in func.value.id.lower()
    )


# What only a module is asked for (an optimizer also has state_dict and zero_grad).
MODULE_ONLY_API = frozenset(
    {"parameters", "named_parameters", "train", "eval", "requires_grad_", "modules",
     "named_modules", "get_input_embeddings", "resize_token_embeddings",
     "gradient_checkpointing_enable"}
)  # fmt: skip


def is_module(script: Script, expr: ast.expr) -> bool:
    """A name the script treats as an nn.Module: it asks for its parameters,
    switches it to train or eval, or reads its embeddings."""
    if not isinstance(expr, ast.Name):
        return False
    return any(
        isinstance(node, ast.Attribute)
        and node.attr in MODULE_ONLY_API
        and isinstance(node.value, ast.Name)
        and node.value.id == expr.id
        for node in script.nodes
    )


def wrapper_of(script: Script, value: ast.expr) -> str | None:
    """The wrapper class `value` constructs (DDP(...), nn.DataParallel(...)), if any;
    Ray Train's prepare_model(model) returns DDP when it runs more than one worker."""
    if isinstance(value, ast.Call):
        name = script.name_of(value.func)
        if short(name) in WRAPPERS:
            return short(name)
        if name.split(".")[0] == "ray" and short(name) == "prepare_model":
            return "DistributedDataParallel"
    return None


def plain_names(target: ast.expr) -> list[str]:
    """Plain names an assignment target binds (`a`, `a, b`), not attributes or items."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in plain_names(element)]
    if isinstance(target, ast.Starred):
        return plain_names(target.value)
    return []


def binding_targets(node: ast.AST) -> list[ast.expr]:
    """What a for loop, a with statement, `x += ...` or `(x := ...)` binds."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    return [node.target]
