"""Reentrant activation checkpointing under DDP (ddp-reentrant-checkpoint).

`torch.utils.checkpoint.checkpoint` in its reentrant variant runs the
checkpointed block's forward under no_grad and, in backward, recomputes it
and runs a nested backward over it. DDP then fails with "Expected to mark a
variable ready only once" in two cases the file can show:

- DDP has find_unused_parameters=True: the block's parameters are not in the
  forward graph DDP searches, so it counts them unused and marks them ready,
  and the nested backward marks them ready again;
- one module is checkpointed several times in one forward (`checkpoint(
  self.block, x)` in a loop): its parameters get gradients in several nested
  backward passes ("Reused parameters in multiple reentrant backward passes").
  DDP documents this as unsupported; whether a given model stops depends on
  when its buckets fill (session 20, torch 2.13 on gloo: the fixture's
  layers-then-shared-block stops, a shared block alone, or a stack recycled
  three times, trained with the same gradients as one process).

Which calls are reentrant: `use_reentrant=True`, and no use_reentrant at all
(torch.utils.checkpoint and checkpoint_sequential read None as True, after a
warning, in torch 2.x up to 2.13 and in pytorch's main branch).
Hugging Face's `gradient_checkpointing_enable()` passes
`{"use_reentrant": True}` when given no gradient_checkpointing_kwargs in
transformers 4.x (huggingface/transformers#28538; #43203 made it False for
v5), and kwargs without the key leave torch's default; a script pins no
version, so it is read as the 4.x most scripts were written for.

Quiet where it works: use_reentrant=False, a value computed elsewhere, a
`**kwargs` that may carry it, `static_graph=True` (or `_set_static_graph()`):
DDP then supports reentrant backward, reused and unused parameters included;
and DDP with no find_unused_parameters=True and no module checkpointed twice
(plain reentrant checkpointing of distinct blocks trains under DDP). A
find_unused_parameters the run decides (`cfg.layerdrop > 0`, `args.flag`) is
read as true: the finding says when it bites.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.rank_dependent import target_value_pairs
from assistant.lint.checks.unused import calls_with_gradients, wrapped_by
from assistant.lint.model import (
    COMPREHENSIONS,
    Script,
    bound_arguments,
    called_name,
    keyword,
    own_nodes,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.registry import check
from assistant.results import Finding

CHECKPOINTS = frozenset(
    {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}
)
# use_reentrant is checkpoint_sequential's fourth positional parameter.
SEQUENTIAL_REENTRANT_POSITION = 3
HF_ENABLE = "gradient_checkpointing_enable"
HF_KWARGS = "gradient_checkpointing_kwargs"
# Where a script says how DDP wraps the model: torch, Accelerate, Lightning.
DDP_CONFIGS = frozenset({"DistributedDataParallel", "DistributedDataParallelKwargs", "DDPStrategy"})
LIGHTNING_FIND_UNUSED = "ddp_find_unused_parameters_true"

REENTRANT, NOT_REENTRANT, UNKNOWN = "reentrant", "not reentrant", "unknown"
UNSUPPORTED = (
    "which DDP without a static graph does not support: depending on when its gradient "
    'buckets fill, it stops with "Expected to mark a variable ready only once"; pass '
    "use_reentrant=False (or DDP(..., static_graph=True))"
)


@check("ddp-reentrant-checkpoint")
def check_reentrant_checkpoint(script: Script) -> Iterator[Finding]:
    """Reentrant checkpointing with DDP's find_unused_parameters=True, or of one
    module several times per forward, and no static graph."""
    configs = [node for node, name in script.call_names if short(name) in DDP_CONFIGS]
    trainer_args = [node for node, name in script.call_names if short(name) == "TrainingArguments"]
    lightning_unused = LIGHTNING_FIND_UNUSED in script.string_constants
    if not (configs or trainer_args or lightning_unused) or static_graph(script, configs):
        return
    unused = unused_parameters_setting(script, configs)
    patched = patches_checkpoint(script)
    own_enable = HF_ENABLE in script.methods_by_name
    loops: Loops | None = None  # built at the first checkpoint call that needs it
    runs: ModelRuns | None = None
    for node, name in script.call_names:
        if name in CHECKPOINTS:
            if torch_checkpoint_mode(node, name, patched) != REENTRANT:
                continue
            variant = (
                f"{short(name)}(...) with use_reentrant=True"
                if keyword(node, "use_reentrant") is not None
                else f"{short(name)}(...) without use_reentrant (torch's default is the "
                "reentrant variant)"
            )
            fix = "pass use_reentrant=False"
            if unused is not None:
                yield unused_finding(script, node, variant, unused, fix)
                continue
            if not configs:
                continue
            loops = loops or Loops(script)
            if module := loops.reused(node):
                yield script.finding(
                    "ddp-reentrant-checkpoint",
                    node,
                    f"{variant} checkpoints {module} inside a loop: its parameters get "
                    f"gradients in several reentrant backward passes, {UNSUPPORTED}",
                )
                continue
            runs = runs or ModelRuns(script, configs)
            if again := runs.run_again(node):
                yield script.finding(
                    "ddp-reentrant-checkpoint",
                    node,
                    f"{variant} {again}: each run checkpoints the same "
                    f"blocks, so their parameters get gradients in several reentrant backward "
                    f"passes, {UNSUPPORTED}",
                )
        elif (
            isinstance(node.func, ast.Attribute)
            and node.func.attr == HF_ENABLE
            and not own_enable
            and unused is not None
            and hf_mode(script, node, node.args[0] if node.args else keyword(node, HF_KWARGS))
            == REENTRANT
        ):
            variant = (
                f"{HF_ENABLE}() without gradient_checkpointing_kwargs (reentrant by default "
                "in transformers 4.x)"
                if not node.args and keyword(node, HF_KWARGS) is None
                else f"{HF_ENABLE}() with reentrant checkpointing"
            )
            fix = f'pass {HF_KWARGS}={{"use_reentrant": False}}'
            yield unused_finding(script, node, variant, unused, fix)
    yield from trainer_arguments(script, trainer_args)


def unused_parameters_setting(script: Script, configs: list[ast.Call]) -> tuple[int, str] | None:
    """Where DDP is told it may find unused parameters, and how it is said:
    `find_unused_parameters=True`, or a value the run decides
    (`find_unused_parameters=cfg.layerdrop > 0`: true whenever that setting is
    on); Lightning's "ddp_find_unused_parameters_true". None if nowhere."""
    for node in configs:
        value = keyword(node, "find_unused_parameters")
        if is_true(value):
            return node.lineno, "find_unused_parameters=True"
        if value is not None and not isinstance(value, ast.Constant):
            return node.lineno, f"find_unused_parameters={source_text(value)}, when that is true"
    if LIGHTNING_FIND_UNUSED not in script.string_constants:
        return None
    line = next(n.lineno for n in script.of_type(ast.Constant) if n.value == LIGHTNING_FIND_UNUSED)
    return line, "find_unused_parameters=True"


def unused_finding(
    script: Script, node: ast.Call, variant: str, unused: tuple[int, str], fix: str
) -> Finding:
    line, setting = unused
    return script.finding(
        "ddp-reentrant-checkpoint",
        node,
        f"{variant} under DDP with {setting} (line {line}): DDP "
        "counts the checkpointed parameters unused in the forward, then the recomputation "
        'in backward marks them ready again ("Expected to mark a variable ready only '
        f'once"); {fix}',
    )


def trainer_arguments(script: Script, calls: list[ast.Call]) -> Iterator[Finding]:
    """`TrainingArguments(gradient_checkpointing=True, ddp_find_unused_parameters=True)`:
    the HF Trainer wraps DDP so, and checkpoints with the kwargs given there."""
    for node in calls:
        if not (
            is_true(keyword(node, "gradient_checkpointing"))
            and is_true(keyword(node, "ddp_find_unused_parameters"))
        ):
            continue
        if any(k.arg is None for k in node.keywords):
            continue
        if hf_mode(script, node, keyword(node, HF_KWARGS)) != REENTRANT:
            continue
        yield script.finding(
            "ddp-reentrant-checkpoint",
            node,
            "gradient_checkpointing=True with ddp_find_unused_parameters=True: the Trainer "
            "checkpoints reentrantly (transformers 4.x default) under a DDP that searches for "
            'unused parameters, so the recomputed ones are marked ready twice ("Expected to '
            f'mark a variable ready only once"); pass {HF_KWARGS}={{"use_reentrant": False}}, '
            "or leave ddp_find_unused_parameters unset",
        )


def is_true(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is True


def static_graph(script: Script, configs: list[ast.Call]) -> bool:
    """DDP(..., static_graph=<anything but False>) or `ddp_model._set_static_graph()`."""
    for node in configs:
        value = keyword(node, "static_graph")
        if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
            return True
    return any(
        isinstance(node.func, ast.Attribute) and node.func.attr == "_set_static_graph"
        for node, _name in script.call_names
    )


def torch_checkpoint_mode(node: ast.Call, name: str, patched: bool) -> str:
    value = keyword(node, "use_reentrant")
    sequential = short(name) == "checkpoint_sequential"
    if value is None and sequential and len(node.args) > SEQUENTIAL_REENTRANT_POSITION:
        value = node.args[SEQUENTIAL_REENTRANT_POSITION]
    if value is None:
        if patched or any(k.arg is None for k in node.keywords):
            return UNKNOWN  # `**kwargs` may carry it; the script replaced the default
        return REENTRANT
    return literal_mode(value)


def literal_mode(value: ast.expr) -> str:
    if isinstance(value, ast.Constant) and value.value is True:
        return REENTRANT
    if isinstance(value, ast.Constant) and value.value is False:
        return NOT_REENTRANT
    return UNKNOWN


def hf_mode(script: Script, node: ast.Call, kwargs: ast.expr | None) -> str:
    """Reentrant or not, from the gradient_checkpointing_kwargs given (or not)."""
    if any(k.arg is None for k in node.keywords):
        return UNKNOWN
    if isinstance(kwargs, ast.Name):
        values = script.assigned_values.get(kwargs.id, [])
        if len(values) != 1:
            return UNKNOWN
        kwargs = values[0]
    if kwargs is None or (isinstance(kwargs, ast.Constant) and kwargs.value is None):
        return REENTRANT
    if isinstance(kwargs, ast.Call) and short(source_text(kwargs.func)) == "dict":
        if any(k.arg is None for k in kwargs.keywords) or kwargs.args:
            return UNKNOWN
        value = keyword(kwargs, "use_reentrant")
        return REENTRANT if value is None else literal_mode(value)
    if not isinstance(kwargs, ast.Dict) or None in kwargs.keys:
        return UNKNOWN
    for key, value in zip(kwargs.keys, kwargs.values, strict=True):
        if isinstance(key, ast.Constant) and key.value == "use_reentrant":
            return literal_mode(value)
    return REENTRANT  # kwargs without the key: torch's own default


def patches_checkpoint(script: Script) -> bool:
    """The script replaces torch's checkpoint function (`torch.utils.checkpoint.checkpoint
    = partial(checkpoint, use_reentrant=False)`), so its default is not torch's."""
    for node in script.of_type(ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Attribute) and script.name_of(target) in CHECKPOINTS:
                return True
    return False


class Loops:
    """For each call inside a loop, the innermost loop of its own function around it,
    and for each loop what its body does: a backward, the `self` fields it assigns.
    Built once per file, so many checkpoint calls cost one walk."""

    def __init__(self, script: Script):
        self.loop_of: dict[int, ast.AST] = {}
        self.backward: dict[int, bool] = {}
        self.fields_set: dict[int, set[str]] = {}
        loops = (ast.For, ast.AsyncFor, ast.While, *COMPREHENSIONS)
        for scope in script.all_scopes:
            for loop in (n for n in script.scope_nodes(scope) if isinstance(n, loops)):
                inside = loop_body_nodes(loop)
                self.backward[id(loop)] = any(
                    isinstance(n, ast.Attribute) and n.attr == "backward" for n in inside
                )
                self.fields_set[id(loop)] = {
                    n.attr
                    for n in inside
                    if isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                }
                for node in inside:
                    if isinstance(node, ast.Call):
                        self.loop_of[id(node)] = loop  # outer loops come first: innermost wins

    def reused(self, call: ast.Call) -> str | None:
        """`self.block` (or `self.block.forward`) checkpointed inside a loop whose body
        runs no backward and does not reassign the field: the same parameters in
        several reentrant passes of one backward. The module's text, or None."""
        loop = self.loop_of.get(id(call))
        if loop is None or not call.args:
            return None
        target = call.args[0]
        if isinstance(target, ast.Attribute) and target.attr == "forward":
            target = target.value
        if not (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            return None
        if self.backward[id(loop)] or target.attr in self.fields_set[id(loop)]:
            return None
        return source_text(target)


# How many fields deep a model's classes are followed (a wrapper's backbone's blocks).
FIELD_DEPTH = 4


class ModelRuns:
    """Where a module that checkpoints is run more than once before one backward:
    a field of a model class called inside a loop of its method, or twice there
    (DINO's multi-crop wrapper runs its backbone once per crop size), and the
    DDP-wrapped model called inside a `range` loop of a training step (an
    autoregressive rollout: `for s in range(k): x = model(x)`, one backward)."""

    def __init__(self, script: Script, configs: list[ast.Call]):
        self.script = script
        self.classes = {
            node.name: node for node in script.tree.body if isinstance(node, ast.ClassDef)
        }
        self.loops = Loops(script)
        self.wrapped: list[tuple[set[str], set[str]]] = [
            wrapped_by(script, config, set(self.classes))
            for config in configs
            if short(script.name_of(config.func)) == "DistributedDataParallel"
        ]

    def run_again(self, checkpoint_call: ast.Call) -> str | None:
        """How the module holding the checkpoint call is run again, or None."""
        owner = self.owner_class(checkpoint_call)
        if owner is None:
            return None
        method = self.enclosing_method(checkpoint_call)
        for field, call in self.fields_run_twice(self.classes.get(owner)):
            if field == method:
                return (
                    f"in {owner}.{method}, which {owner} runs several times in one forward "
                    f"(self.{method} on line {call.lineno})"
                )
        for cls in self.classes.values():
            for field, call in self.fields_run_twice(cls):
                if owner in self.held_by_field(cls, field, FIELD_DEPTH):
                    return (
                        f"in {owner}, which {cls.name} runs several times in one forward "
                        f"(self.{field} on line {call.lineno})"
                    )
        for holders, built in self.wrapped:
            if not any(owner in self.reached_from(name, FIELD_DEPTH) for name in built):
                continue
            for call in self.training_calls_in_a_range_loop(holders):
                return (
                    f"in {owner}, part of the DDP-wrapped model, which runs several times "
                    f"before one backward (line {call.lineno}, in a loop over range)"
                )
        return None

    def owner_class(self, node: ast.AST) -> str | None:
        parent = self.script.parents.get(id(node))
        while parent is not None and not isinstance(parent, ast.ClassDef):
            parent = self.script.parents.get(id(parent))
        return parent.name if parent is not None else None

    def enclosing_method(self, node: ast.AST) -> str | None:
        """The name of the method of a class that `node` lies in."""
        child, parent = node, self.script.parents.get(id(node))
        while parent is not None and not isinstance(parent, ast.ClassDef):
            child, parent = parent, self.script.parents.get(id(parent))
        return child.name if isinstance(child, ast.FunctionDef) else None

    def fields_run_twice(self, cls: ast.ClassDef | None) -> Iterator[tuple[str, ast.Call]]:
        """`self.backbone(...)` (or a method of its own, `self.extract(...)`) inside a
        loop of a method (with no backward in it), or called twice in one method."""
        if cls is None:
            return
        for method in (s for s in cls.body if isinstance(s, ast.FunctionDef)):
            seen: dict[str, int] = {}
            for node in own_nodes(method):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                field = node.func.attr
                if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                    continue
                seen[field] = seen.get(field, 0) + 1
                loop = self.loops.loop_of.get(id(node))
                looped = loop is not None and not self.loops.backward[id(loop)]
                if seen[field] == 2 or looped or self.in_a_comprehension(node, method):
                    yield field, node

    def in_a_comprehension(self, node: ast.AST, method: ast.FunctionDef) -> bool:
        """`[self.backbone(c) for c in crops]`: run once per item."""
        parent = self.script.parents.get(id(node))
        while parent is not None and parent is not method:
            if isinstance(parent, COMPREHENSIONS):
                return True
            parent = self.script.parents.get(id(parent))
        return False

    def held_by_field(self, cls: ast.ClassDef, field: str, depth: int) -> set[str]:
        """The file's classes built into `self.field` of cls, and those their fields hold."""
        held: set[str] = set()
        for value in self.field_values(cls, field):
            for built in self.classes_built(value):
                held |= self.reached_from(built, depth - 1)
        return held

    def reached_from(self, name: str, depth: int) -> set[str]:
        """The class and the classes its fields hold, `depth` fields deep."""
        reached = {name}
        cls = self.classes.get(name)
        if cls is None or depth <= 0:
            return reached
        fields = {
            target.attr
            for node in walk(cls)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Attribute) and self_attribute(target)
        }
        for field in sorted(fields):
            reached |= self.held_by_field(cls, field, depth)
        return reached

    def field_values(self, cls: ast.ClassDef, field: str) -> list[ast.expr]:
        """What `self.field = ...` is given, and for a parameter of __init__ assigned
        to it, what the file's constructions of the class pass for it."""
        values: list[ast.expr] = []
        init = next(
            (s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None
        )
        for node in walk(cls):
            if not isinstance(node, ast.Assign):
                continue
            for target, value in target_value_pairs(node):
                if self_attribute(target) != field:
                    continue
                values.append(value)
                if init is not None and isinstance(value, ast.Name):
                    values += self.passed_to(cls.name, init, value.id)
        return values

    def passed_to(self, cls_name: str, init: ast.FunctionDef, parameter: str) -> list[ast.expr]:
        return [
            argument
            for node, name in self.script.call_names
            if short(name) == cls_name
            for bound, argument in bound_arguments(init, node, self_bound=True)
            if bound == parameter
        ]

    def classes_built(self, value: ast.expr) -> set[str]:
        """The file's classes a value constructs, directly or through a function of the
        file that returns one (`vit(use_checkpoint=True)`)."""
        built: set[str] = set()
        for node in walk(value):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id in self.classes:
                built.add(node.func.id)
            elif partial := self.partial_class(node.func.id):
                built.add(partial)  # `vit = partial(ViT, depth=12)` ... `vit(...)`
            elif (function := self.script.functions.get(node.func.id)) is not None:
                built |= {
                    n.func.id
                    for r in own_nodes(function)
                    if isinstance(r, ast.Return) and r.value is not None
                    for n in walk(r.value)
                    if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name)
                    and n.func.id in self.classes
                }
        return built

    def partial_class(self, name: str) -> str | None:
        """The file's class a name holds bound by functools.partial, if that is all it holds."""
        values = self.script.assigned_values.get(name, [])
        classes = {
            value.args[0].id
            for value in values
            if isinstance(value, ast.Call)
            and short(self.script.name_of(value.func)) == "partial"
            and value.args
            and isinstance(value.args[0], ast.Name)
            and value.args[0].id in self.classes
        }
        return next(iter(classes)) if len(classes) == 1 and len(values) == 1 else None

    def training_calls_in_a_range_loop(self, holders: set[str]) -> Iterator[ast.Call]:
        """Calls of the wrapped model inside a `for ... in range(...)` loop whose body
        runs no backward, outside no_grad."""
        for node, _nodes in calls_with_gradients(self.script, holders):
            loop = self.loops.loop_of.get(id(node))
            if (
                isinstance(loop, ast.For)
                and isinstance(loop.iter, ast.Call)
                and called_name(loop.iter) == "range"
                and not self.loops.backward[id(loop)]
            ):
                yield node


def loop_body_nodes(loop: ast.AST) -> list[ast.AST]:
    """What a loop runs each pass: its body's statements, or a comprehension's
    element (`[checkpoint(self.mlp, h[s:s + n]) for s in range(0, len(h), n)]`)."""
    if isinstance(loop, COMPREHENSIONS):
        parts = [loop.key, loop.value] if isinstance(loop, ast.DictComp) else [loop.elt]
        return [n for part in parts for n in (part, *own_nodes(part))]
    return [n for stmt in loop.body for n in own_nodes_of(stmt)]


def own_nodes_of(stmt: ast.stmt) -> Iterator[ast.AST]:
    """`stmt` and the nodes under it, not inside functions or classes defined there."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return
    yield stmt
    yield from own_nodes(stmt)
