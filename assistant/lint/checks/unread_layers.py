"""A layer the wrapped model builds that nothing in the file ever reads (unused-parameters).

`wpe=nn.Embedding(block_size, n_embd)` kept in a GPT after its positions moved
to rotary embeddings; the pre-training heads (`self.itm_head`, `self.vision_proj`)
of a model fine-tuned for another task. The layer's parameters are registered,
so DDP built without find_unused_parameters waits for their gradients, which
no step ever gives: the second iteration fails with "Expected to have finished
reduction in the prior iteration before starting a new one".

Only what nothing can reach is reported: a field of the wrapped model (or of a
model class of the file it builds), or an entry of a ModuleDict it builds, whose
name is read nowhere in the file, as an attribute or as a string (a freeze by
name, a `getattr`). A class that reaches its fields by other means
(`getattr(self, ...)`, `self.children()`, `super().forward`) is left alone, and
so is a ModuleDict read other than entry by named entry.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.unused import (
    built_classes,
    model_classes,
    strict_ddp_calls,
    wrapped_by,
)
from assistant.lint.checks.unused_paths import (
    MODEL_FACTORIES,
    WITHOUT_PARAMETERS,
    frozen,
    training_calls,
)
from assistant.lint.model import (
    Script,
    called_name,
    self_attribute,
    string_keyed_entries,
    walk,
)
from assistant.lint.registry import check
from assistant.results import Finding

# What a class reads its own fields through without naming them.
DYNAMIC_READS = frozenset(
    {"children", "named_children", "modules", "named_modules", "_modules", "__dict__"}
)
CONTAINERS = frozenset({"ModuleDict"})


@check("unused-parameters")
def check_layer_nothing_reads(script: Script) -> Iterator[Finding]:
    """A layer of the DDP-wrapped model, built with parameters, read nowhere in the file."""
    strict = strict_ddp_calls(script)
    if not strict:
        return
    classes = {cls.name: cls for cls in model_classes(script)}
    read = names_read(script)
    frozen_fields = frozen(script)
    reported: set[int] = set()
    for ddp in strict:
        holders, built = wrapped_by(script, ddp, set(classes))
        holders -= set(classes) | set(script.functions)
        if next(training_calls(script, holders), None) is None:
            continue
        for name in sorted(built):
            for cls in built_classes(classes, name):
                if reads_fields_dynamically(cls):
                    continue
                for member, layer in layers_of(script, cls, classes):
                    if member in read or member in frozen_fields or id(layer) in reported:
                        continue
                    reported.add(id(layer))
                    yield script.finding(
                        "unused-parameters",
                        layer,
                        f"{cls.name} builds {member} ({called_name(layer)}), but nothing in "
                        "the file ever runs or reads it: its parameters get no gradient, and "
                        f"DDP (line {ddp.lineno}) expects one for every parameter each step and "
                        'fails with "Expected to have finished reduction in the prior '
                        'iteration"; remove the layer (or freeze it), or pass '
                        "find_unused_parameters=True",
                    )


def names_read(script: Script) -> set[str]:
    """Every attribute name the file reads and every string it holds, but the keys
    of the ModuleDicts it writes out (`{"wpe": nn.Embedding(...)}`): what may name
    a field."""
    keys = {
        id(key)
        for node in script.of_type(ast.Call)
        if called_name(node) in CONTAINERS and node.args and isinstance(node.args[0], ast.Dict)
        for key in node.args[0].keys
    }
    read = {node.attr for node in script.of_type(ast.Attribute) if isinstance(node.ctx, ast.Load)}
    return read | {
        node.value
        for node in script.of_type(ast.Constant)
        if isinstance(node.value, str) and id(node) not in keys
    }


def reads_fields_dynamically(cls: ast.ClassDef) -> bool:
    """`getattr(self, name)`, `self.children()`, `vars(self)`, `super().forward(x)`
    (a base class's method, which may read any field; `super().__init__()` does not)."""
    for node in walk(cls):
        if isinstance(node, ast.Attribute) and node.attr in DYNAMIC_READS:
            return True
        if isinstance(node, ast.Attribute) and node.attr != "__init__" and is_super(node.value):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "vars"}
            and any(isinstance(a, ast.Name) and a.id == "self" for a in node.args)
        ):
            return True
    return False


def is_super(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def layers_of(
    script: Script, cls: ast.ClassDef, classes: dict[str, ast.ClassDef]
) -> Iterator[tuple[str, ast.Call]]:
    """(name, the call that builds it) for each layer with parameters the class
    sets as a field (`self.head = nn.Linear(...)`), and each entry of a ModuleDict
    it sets (`nn.ModuleDict(dict(wte=..., wpe=...))`)."""
    for node in walk(cls):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if not any(self_attribute(target) for target in node.targets):
            continue
        value = node.value
        if called_name(value) in CONTAINERS and value.args:
            entries = string_keyed_entries(value.args[0])
            keys = {key for key, _entry in entries}
            fields = [self_attribute(target) for target in node.targets]
            if any(field and read_as_a_whole(script, field, keys) for field in fields):
                continue  # `self.heads.values()`, `self.heads[name]`: any entry may run
            for key, entry in entries:
                if isinstance(entry, ast.Call) and has_parameters(script, entry, classes):
                    yield key, entry
        elif has_parameters(script, value, classes):
            for target in node.targets:
                if member := self_attribute(target):
                    yield member, value


def read_as_a_whole(script: Script, field: str, keys: set[str]) -> bool:
    """Some read of `.field` is not of one of its entries by name (`.field.wte`,
    `.field["wte"]`): `.field.values()`, `.field[name]`, `for m in .field`."""
    for node in script.nodes:
        if not (
            isinstance(node, ast.Attribute)
            and node.attr == field
            and isinstance(node.ctx, ast.Load)
        ):
            continue
        parent = script.parents.get(id(node))
        if isinstance(parent, ast.Attribute) and parent.value is node and parent.attr in keys:
            continue
        if (
            isinstance(parent, ast.Subscript)
            and parent.value is node
            and isinstance(parent.slice, ast.Constant)
            and parent.slice.value in keys
        ):
            continue
        return True
    return False


# torch.nn containers: they hold parameters only through the layers they hold.
LAYER_HOLDERS = frozenset({"ModuleList", "Sequential", "ModuleDict"})


def contained_layers(container: ast.Call) -> list[ast.Call]:
    """The layers a container is built with, when every one is a call written out:
    `Sequential(a, b)`, `ModuleList([a, b])`, `ModuleList([a(i) for i in ...])`,
    `ModuleDict({"k": a})`; [] when any is something else (a name, a star)."""
    items: list[ast.expr] = []
    for argument in container.args:
        if isinstance(argument, ast.List | ast.Tuple):
            items += argument.elts
        elif isinstance(argument, ast.ListComp | ast.GeneratorExp):
            items.append(argument.elt)
        elif isinstance(argument, ast.Dict):
            items += argument.values
        elif isinstance(argument, ast.DictComp):
            items.append(argument.value)
        else:
            items.append(argument)
    calls = [item for item in items if isinstance(item, ast.Call)]
    return calls if calls and len(calls) == len(items) else []


def has_parameters(script: Script, value: ast.Call, classes: dict[str, ast.ClassDef]) -> bool:
    """A torch.nn layer with parameters, a model class of the file, a library's model."""
    name = script.name_of(value.func)
    short_name = called_name(value)
    if short_name in LAYER_HOLDERS and name.startswith("torch.nn."):
        layers = contained_layers(value)
        if layers:  # `nn.ModuleList([nn.Upsample(...) for ...])`: what it holds decides
            return any(has_parameters(script, layer, classes) for layer in layers)
    if name.startswith("torch.nn.") and not name.startswith("torch.nn.functional."):
        return short_name not in WITHOUT_PARAMETERS and not short_name.endswith("Loss")
    if isinstance(value.func, ast.Name) and value.func.id in classes:
        return True
    return short_name in MODEL_FACTORIES
