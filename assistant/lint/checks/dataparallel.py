"""A model whose forward returns its scalar loss, run through nn.DataParallel
(dataparallel-unsafe-model).

DataParallel runs one replica per GPU and gathers their outputs along
dimension 0. A replica that returns a 0-d loss gives N scalars, which the
gather turns into a vector of N ("Was asked to gather along dimension 0, but
all input tensors were scalars; will instead unsqueeze and return a
vector"), and `loss.backward()` on it fails: "grad can be implicitly created
only for scalar outputs". One GPU hides it: a single replica's scalar comes
back as it is.

Read only where the file shows all three: the model's class (built into the
DataParallel call, or into the name it wraps), a `return` in its forward of
a loss function's value or a bare `.mean()` / `.sum()` (alone, or as one
element of a returned tuple: `return pred, self.loss_fn(pred, y)`), and a
`.backward()` straight on what calling the wrapper returned, or on that
element unpacked from it (`_, loss = model(x, y)`), with no `.mean()` in
between.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.unused import built_classes, forward_of, model_classes, wrapped_by
from assistant.lint.model import (
    Script,
    called_name,
    keyword,
    method_of,
    own_nodes,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.registry import check
from assistant.results import Finding

DATA_PARALLEL = "DataParallel"
# A call whose value is a loss: torch's losses (mse_loss, cross_entropy, nll_loss...),
# a criterion, a `loss_fn`.
LOSS_CALL = re.compile(
    r"(loss|loss_fn|loss_func|loss_fct|criterion|cross_entropy|kl_div)$", re.IGNORECASE
)
REDUCTIONS = frozenset({"mean", "sum"})


@check("dataparallel-unsafe-model")
def check_scalar_loss_gathered_by_data_parallel(script: Script) -> Iterator[Finding]:
    """`loss = model(x, y); loss.backward()` where model is nn.DataParallel over a
    class whose forward returns the scalar loss: the gather makes it a vector."""
    wrappers = [node for node, name in script.call_names if short(name) == DATA_PARALLEL]
    if not wrappers:
        return
    classes = {cls.name: cls for cls in model_classes(script)}
    for wrapper in wrappers:
        names, built = wrapped_by(script, wrapper, set(classes))
        returns: dict[int | None, int] = {}
        for name in built:
            for position, line in scalar_returns(classes[name]).items():
                returns.setdefault(position, line)
        if not returns:
            continue
        for backward, call, position in backward_on_wrapper_output(script, names):
            if position not in returns:
                continue
            yield script.finding(
                "dataparallel-unsafe-model",
                backward,
                f"{source_text(call.func)}() is nn.DataParallel (line {wrapper.lineno}) over a "
                f"model whose forward returns its scalar loss (line {returns[position]}): each "
                "GPU's replica returns one, the gather makes them a vector, and backward() fails "
                'with "grad can be implicitly created only for scalar outputs"; take '
                ".mean() of it first, or return the outputs and compute the loss outside",
            )


def scalar_returns(cls: ast.ClassDef) -> dict[int | None, int]:
    """Where forward returns a loss's value or a bare `.mean()` / `.sum()`, directly or
    through the name forward assigned it to (or unpacked it into, named as a loss):
    {None: line} for the whole return value,
    {i: line} for element i of a returned tuple."""
    forward = forward_of(cls)
    assigned: dict[str, list[ast.expr]] = {}
    for node in walk(forward):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
                elif isinstance(target, ast.Tuple) and is_scalar_loss(node.value):
                    # `loss, loss_stats = self.loss(out, batch)`: a criterion that
                    # returns its statistics too; the element named as a loss is one
                    for element in target.elts:
                        if isinstance(element, ast.Name) and LOSS_CALL.search(element.id):
                            assigned.setdefault(element.id, []).append(node.value)

    def scalar(value: ast.expr) -> bool:
        values = assigned.get(value.id, []) if isinstance(value, ast.Name) else [value]
        return bool(values) and all(is_scalar_loss(v) for v in values)

    found: dict[int | None, int] = {}
    for node in walk(forward):
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        if isinstance(node.value, ast.Tuple):
            for position, element in enumerate(node.value.elts):
                if scalar(element):
                    found.setdefault(position, node.lineno)
        elif scalar(node.value):
            found.setdefault(None, node.lineno)
    return found


def is_scalar_loss(value: ast.expr) -> bool:
    """A loss function's value, or a bare `.mean()` / `.sum()`."""
    if not isinstance(value, ast.Call):
        return False
    name = called_name(value) or ""
    if LOSS_CALL.search(name):
        return True
    return name in REDUCTIONS and not value.args and not value.keywords


def backward_on_wrapper_output(
    script: Script, wrappers: set[str]
) -> Iterator[tuple[ast.Call, ast.Call, int | None]]:
    """(the backward call, the wrapper's call, the position of the output) for
    `wrapper(...).backward()`, `loss = wrapper(...)` ... `loss.backward()` (position
    None), and `_, loss = wrapper(...)` ... `loss.backward()` (position 1), where the
    scope binds `loss` nowhere else."""
    for scope in script.all_scopes:
        nodes = list(own_nodes(scope))
        bound: dict[str, list[tuple[ast.expr | None, int | None]]] = {}
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        bound.setdefault(target.id, []).append((node.value, None))
                    elif isinstance(target, ast.Tuple):
                        for position, element in enumerate(target.elts):
                            if isinstance(element, ast.Name):
                                bound.setdefault(element.id, []).append((node.value, position))
        for node in nodes:
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "backward"
                and not node.args
                and not node.keywords
            ):
                continue
            receiver = node.func.value
            values = (
                bound.get(receiver.id, []) if isinstance(receiver, ast.Name) else [(receiver, None)]
            )
            positions = {position for _value, position in values}
            if (
                values
                and len(positions) == 1
                and all(is_wrapper_call(value, wrappers) for value, _p in values)
            ):
                yield node, values[0][0], positions.pop()


def is_wrapper_call(value: ast.expr | None, wrappers: set[str]) -> bool:
    return isinstance(value, ast.Call) and source_text(value.func) in wrappers


# torch.nn.utils.rnn's unpacking, padded to the longest sequence it was given.
PAD_PACKED = "pad_packed_sequence"


@check("dataparallel-unsafe-model")
def check_packed_sequence_unpadded_under_data_parallel(script: Script) -> Iterator[Finding]:
    """`pad_packed_sequence(out, batch_first=True)` without `total_length=` in the
    forward of a model (or a block it builds) that nn.DataParallel wraps: each
    replica pads to the longest sequence of its own slice of the batch, so the
    replicas return different time lengths and the gather on the first GPU fails
    ("Sizes of tensors must match except in dimension 0"); one GPU hides it. The
    fix PyTorch documents (FAQ, recurrent networks and data parallelism):
    `total_length=padded_input.size(1)`."""
    reported: set[int] = set()
    for wrapper, cls in classes_run_by_data_parallel(script):
        for node in walk(cls):
            if (
                isinstance(node, ast.Call)
                and called_name(node) == PAD_PACKED
                and keyword(node, "total_length") is None
                and node.lineno not in reported
            ):
                reported.add(node.lineno)
                yield script.finding(
                    "dataparallel-unsafe-model",
                    node,
                    f"{PAD_PACKED}() without total_length in {cls.name}, which "
                    f"nn.DataParallel runs on each GPU's slice of the batch (line "
                    f"{wrapper.lineno}): each replica pads to the longest sequence of "
                    "its own slice, so the replicas return different lengths and the "
                    'gather fails ("Sizes of tensors must match except in dimension '
                    '0"); pass total_length=<the padded input>.size(1)',
                )


@check("dataparallel-unsafe-model")
def check_state_set_in_forward_under_data_parallel(script: Script) -> Iterator[Finding]:
    """`self.v = ...` in the forward of a model (or a block it builds) that
    nn.DataParallel wraps, where the file reads that field again (a recurrent state
    carried between calls, an EMA codebook, attention weights read after the step):
    DataParallel runs forward on replicas it makes for each call and throws away, so
    the assignment lands on a replica and the model keeps its old value (the
    PyTorch docs' warning on in-place updates in forward under DataParallel)."""
    read = {node.attr for node in script.of_type(ast.Attribute) if isinstance(node.ctx, ast.Load)}
    reported: set[str] = set()
    for wrapper, cls in classes_run_by_data_parallel(script):
        forward = method_of(cls, "forward")
        if forward is None:
            continue
        for node in own_nodes(forward):
            if not isinstance(node, ast.Assign | ast.AugAssign):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                field = self_attribute(target)
                if field is None or field not in read or f"{cls.name}.{field}" in reported:
                    continue
                reported.add(f"{cls.name}.{field}")
                yield script.finding(
                    "dataparallel-unsafe-model",
                    node,
                    f"{cls.name}.forward sets self.{field}, and nn.DataParallel (line "
                    f"{wrapper.lineno}) runs forward, on several GPUs, on replicas it "
                    "makes for each call and throws away: the value lands on a "
                    "replica, and the model "
                    f"keeps its old self.{field} (a state carried to the next call, a "
                    "statistic read after the step); return it from forward, keep it "
                    "outside the module, or train with DistributedDataParallel",
                )


def classes_run_by_data_parallel(script: Script) -> Iterator[tuple[ast.Call, ast.ClassDef]]:
    """(the nn.DataParallel call, a model class of the file it runs: the wrapped
    model's and the blocks it builds)."""
    wrappers = [node for node, name in script.call_names if short(name) == DATA_PARALLEL]
    classes = {cls.name: cls for cls in model_classes(script)} if wrappers else {}
    for wrapper in wrappers:
        _names, built = wrapped_by(script, wrapper, set(classes))
        for name in sorted(built):
            for cls in built_classes(classes, name):
                yield wrapper, cls
