"""Data-loading workers that touch CUDA after the main process has (cuda-init-before-fork).

A DataLoader with `num_workers > 0` forks its workers on Linux. In a
distributed script the main process has already initialised CUDA
(set_device, NCCL, the model on the GPU), and CUDA cannot be initialised
again in a forked child: the first worker that moves a tensor or a model to
the GPU dies with "Cannot re-initialize CUDA in forked subprocess".

Reported: a Dataset's `__getitem__` / `__getitems__` / `__iter__` (and the
file's functions they call), or a `collate_fn`, that moves something to a
CUDA device, read by a DataLoader given workers; or a field its `__init__`
put on the GPU and those methods read (the worker then fails with "CUDA
error: initialization error", seen on an H200: tests/fixtures/gpu/runs.json).
Quiet where the script chose another start method (`multiprocessing_context=`,
`set_start_method`), where the workers are a literal 0, and where the device
is said to be the CPU.

The same fork, made by the script itself: `mp.Process(target=actor_loop,
...)` started after this process set its GPU (an Ape-X / IMPALA learner
forking its actors), whose target, or the file's functions it calls, puts a
model or a tensor on the GPU; also `mp.start_processes(fn, ...,
start_method="fork")` after CUDA started, in the calling function or at the
module's top level on import (a notebook's sanity check of the model on the
GPU). Quiet with a start method chosen, and for a process made from a context
(`mp.get_context("spawn").Process`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.devices import is_cpu
from assistant.lint.model import (
    Function,
    Script,
    keyword,
    own_nodes,
    position,
    self_attribute,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import enclosing_scope
from assistant.lint.registry import check
from assistant.lint.torchapi import is_ddp, is_distributed
from assistant.lint.tracer import is_main_guard, same_file_callees
from assistant.results import Finding

# What the workers run for a dataset: the item and batch readers, the stream.
WORKER_METHODS = ("__getitem__", "__getitems__", "__iter__")
# A device argument that names the GPU: `self.device`, `local_rank`, "cuda:0".
GPU_DEVICE = re.compile(r"cuda|device|gpu|rank", re.IGNORECASE)
# Methods followed from a worker method (self.encode -> self._codec -> ...).
MAX_METHODS = 16
# A process started with the module's default start method: fork, on Linux.
FORKED_PROCESSES = frozenset({"torch.multiprocessing.Process", "multiprocessing.Process"})
# torch.multiprocessing.start_processes(fn, ..., start_method="fork"): mp.spawn's
# sibling, forking when told to.
STARTS_PROCESSES = "torch.multiprocessing.start_processes"
FORK_HOW = dict.fromkeys(FORKED_PROCESSES, "the default start method on Linux") | {
    STARTS_PROCESSES: 'start_method="fork"'
}
SPAWN_HOW = dict.fromkeys(FORKED_PROCESSES, "start it from mp.get_context('spawn')") | {
    STARTS_PROCESSES: 'start it with start_method="spawn" (mp.spawn)'
}


@check("cuda-init-before-fork")
def check_cuda_in_forked_workers(script: Script) -> Iterator[Finding]:
    """`Dataset.__getitem__` calls `.to(self.device)` and `DataLoader(ds, num_workers=6)`."""
    # A start method chosen for the script (spawn, forkserver) forks no CUDA.
    if not is_distributed(script) or "set_start_method" in script.called_short_names:
        return
    classes = {node.name: node for node in script.of_type(ast.ClassDef)}
    reported: set[int] = set()
    for loader in forking_loaders(script):
        for owner, functions in worker_code(script, classes, loader):
            move = first_gpu_move(functions)
            if move is None:
                held = gpu_held_attribute(script, owner, functions)
                if held is not None and id(held[0]) not in reported:
                    reported.add(id(held[0]))
                    yield held_on_gpu(script, owner, loader, *held)
                continue
            if id(move) in reported:
                continue
            reported.add(id(move))
            yield script.finding(
                "cuda-init-before-fork",
                move,
                f"{owner} moves data to the GPU ({shown_move(move)}) inside the DataLoader's "
                f"workers (line {loader.lineno}), which are forked after this process "
                "initialised CUDA: they fail with 'Cannot re-initialize CUDA in forked "
                "subprocess'; return CPU tensors and move the batch in the training loop, "
                "or pass multiprocessing_context='spawn'",
            )


def gpu_held_attribute(
    script: Script, owner: str, functions: list[Function]
) -> tuple[ast.Call, str] | None:
    """(the GPU move, the field) where the dataset's __init__ puts a field on the GPU
    (`self.x = torch.randn(n, d, device=device)`) that its worker methods read."""
    init = script.functions.get(f"{owner.split('.')[0]}.__init__") if "." in owner else None
    if init is None:
        return None
    read = {
        self_attribute(node)
        for function in functions
        for node in walk(function)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
    }
    for node in walk(init):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        field = self_attribute(node.targets[0])
        if field is None or field not in read:
            continue
        calls = (c for c in walk(node.value) if isinstance(c, ast.Call))
        move = next((c for c in calls if moves_to_gpu(c)), None)
        if move is not None:
            return move, field
    return None


def held_on_gpu(
    script: Script, owner: str, loader: ast.Call, move: ast.Call, field: str
) -> Finding:
    return script.finding(
        "cuda-init-before-fork",
        move,
        f"the dataset keeps self.{field} on the GPU, and {owner} reads it inside the "
        f"DataLoader's workers (line {loader.lineno}), which are forked after this process "
        "initialised CUDA: a forked worker cannot use CUDA ('CUDA error: initialization "
        "error'); keep the dataset's tensors on the CPU and move each batch in the "
        "training loop, or pass multiprocessing_context='spawn'",
    )


def forking_loaders(script: Script) -> Iterator[ast.Call]:
    """DataLoaders given workers and no start method of their own."""
    for node, name in script.call_names:
        if short(name) != "DataLoader":
            continue
        workers = keyword(node, "num_workers")
        if workers is None or is_zero(workers) or keyword(node, "multiprocessing_context"):
            continue
        yield node


def is_zero(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value == 0


def worker_code(
    script: Script, classes: dict[str, ast.ClassDef], loader: ast.Call
) -> Iterator[tuple[str, list[Function]]]:
    """(what it is, the functions it runs in the workers) for the loader's dataset and collate_fn."""
    dataset = loader.args[0] if loader.args else keyword(loader, "dataset")
    if dataset is not None and not said_cpu(script, dataset):
        for name in instance_classes(script, dataset):
            methods = [f"{name}.{m}" for m in WORKER_METHODS if f"{name}.{m}" in script.functions]
            if name in classes and methods:
                yield methods[0], reached(script, name, methods)
    for qualified, owner in collate_functions(script, loader):
        functions = [script.functions[qualified]]
        yield qualified, reached(script, owner, [qualified]) if owner else functions


def collate_functions(script: Script, loader: ast.Call) -> Iterator[tuple[str, str | None]]:
    """(qualified name, its class or None) of the file's functions that the loader's
    collate_fn runs: `Collator(...)`'s __call__, or a function passed by name."""
    collate = keyword(loader, "collate_fn")
    if collate is None:
        return
    for name in instance_classes(script, collate):
        if f"{name}.__call__" in script.functions:
            yield f"{name}.__call__", name
    if isinstance(collate, ast.Name) and collate.id in script.functions:
        yield collate.id, None


def instance_classes(script: Script, expr: ast.expr) -> list[str]:
    """Class names `expr` is an instance of: `Clips(...)` or a name assigned one."""
    values = [expr]
    if isinstance(expr, (ast.Name, ast.Attribute)):
        values = script.assigned_values.get(source_text(expr), [])
    return [
        value.func.id
        for value in values
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
    ]


def said_cpu(script: Script, dataset: ast.expr) -> bool:
    """The dataset is built with the CPU as its device: `Clips(files, device="cpu")`."""
    values = [dataset, *script.assigned_values.get(source_text(dataset), [])]
    return any(
        is_cpu(node) for value in values if isinstance(value, ast.Call) for node in walk(value)
    )


@check("cuda-init-before-fork")
def check_cuda_in_forked_processes(script: Script) -> Iterator[Finding]:
    """`p = mp.Process(target=actor_loop, args=(..., device)); p.start()` after
    `torch.cuda.set_device(local_rank)`, with actor_loop's `QNet().to(device)`."""
    if not is_distributed(script) or "set_start_method" in script.called_short_names:
        return
    for call, name in script.call_names:
        target = forked_target(call, name)
        if not isinstance(target, ast.Name):
            continue
        initialised = cuda_initialised_before(script, call)
        if initialised is None:
            continue
        move = first_gpu_move(reached(script, None, [target.id]))
        if move is None:
            continue
        yield script.finding(
            "cuda-init-before-fork",
            call,
            f"{target.id}() runs in a process forked ({FORK_HOW[name]}) after this one "
            f"initialised CUDA (line {initialised.lineno}), and moves to the GPU there (line "
            f"{move.lineno}: {shown_move(move)}): the child fails with 'Cannot re-initialize "
            f"CUDA in forked subprocess'; {SPAWN_HOW[name]} (its arguments must then pickle), "
            "or keep the child on the CPU",
        )


def forked_target(call: ast.Call, name: str) -> ast.expr | None:
    """The function a process started by forking runs: `Process(target=f)`, or
    `start_processes(f, ..., start_method="fork")`."""
    if name in FORKED_PROCESSES:
        return keyword(call, "target")
    method = keyword(call, "start_method")
    if name == STARTS_PROCESSES and isinstance(method, ast.Constant) and method.value == "fork":
        return keyword(call, "fn") or (call.args[0] if call.args else None)
    return None


def cuda_initialised_before(script: Script, call: ast.Call) -> ast.Call | None:
    """A call before `call` that initialises CUDA in this process: set_device, a move
    to the GPU, or DDP (read as over a GPU model: the check only asks where the
    forked target moves to the GPU too), in the same function or at the module's
    top level, which runs on import (a notebook's sanity check of the model)."""
    scope = enclosing_scope(call, script)
    if scope is None:
        return None
    on_import = [] if scope is script.tree else imported_calls(script)
    earlier = [
        *on_import,
        *(
            node
            for node in own_nodes(scope)
            if isinstance(node, ast.Call) and position(node) < position(call)
        ),
    ]
    for node in earlier:
        name = script.name_of(node.func) or ""
        if name == "torch.cuda.set_device" or is_ddp(name) or moves_to_gpu(node):
            return node
    return None


def imported_calls(script: Script) -> list[ast.Call]:
    """Calls of the module's top level outside `if __name__ == "__main__":`: they run
    on import, before any function the file defines is called."""
    guarded = {
        id(node)
        for statement in script.tree.body
        if is_main_guard(statement)
        for node in ast.walk(statement)
    }
    return [
        node
        for node in own_nodes(script.tree)
        if isinstance(node, ast.Call) and id(node) not in guarded
    ]


def reached(script: Script, class_name: str | None, start: list[str]) -> list[Function]:
    """The functions `start` names and the file's functions they call, as the tracer
    reads a call: `self.encode()` in the class, a helper, a class's __init__."""
    seen: list[str] = []
    pending = list(start)
    while pending and len(seen) < MAX_METHODS:
        qualified = pending.pop()
        if qualified in seen or qualified not in script.functions:
            continue
        seen.append(qualified)
        for node in walk(script.functions[qualified]):
            if isinstance(node, ast.Call):
                pending.extend(same_file_callees(script, node.func, class_name))
    return [script.functions[name] for name in seen]


def first_gpu_move(functions: list[Function]) -> ast.Call | None:
    """The first `x.cuda()`, `x.to(<a GPU device>)` or factory given a GPU `device=`;
    not `.to(y.device)` with `y` a tensor of the function: that follows y, which
    in a worker is on the CPU unless an earlier move put it on the GPU."""
    moves = [
        node
        for function in functions
        for node in walk(function)
        if isinstance(node, ast.Call)
        and moves_to_gpu(node)
        and not follows_a_tensor(node, tensors_of(function))
    ]
    return min(moves, key=lambda node: (node.lineno, node.col_offset), default=None)


# What only a tensor has: `y.shape`, `y.unsqueeze(1)`; a config object's
# `args.device` is a device, a tensor's `y.device` is wherever y already is.
TENSOR_USES = frozenset(
    {
        "shape", "dtype", "size", "numel", "dim", "ndim", "unsqueeze", "squeeze", "view",
        "reshape", "flatten", "transpose", "permute", "contiguous", "detach", "clone",
        "float", "half", "abs", "clamp", "sum", "mean",
    }
)  # fmt: skip


def tensors_of(function: Function) -> set[str]:
    """The plain names the function uses as tensors (`y.unsqueeze(1)`, `x.shape`)."""
    return {
        node.value.id
        for node in walk(function)
        if isinstance(node, ast.Attribute)
        and node.attr in TENSOR_USES
        and isinstance(node.value, ast.Name)
    }


def follows_a_tensor(call: ast.Call, tensors: set[str]) -> bool:
    """`.to(y.device)` / `device=y.device` with `y` one of `tensors`."""
    device = keyword(call, "device")
    if device is None and isinstance(call.func, ast.Attribute) and call.args:
        device = call.args[0]
    return (
        isinstance(device, ast.Attribute)
        and device.attr == "device"
        and isinstance(device.value, ast.Name)
        and device.value.id in tensors
    )


def moves_to_gpu(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "cuda":
        return True
    device = keyword(call, "device")
    if device is None and isinstance(func, ast.Attribute) and func.attr == "to" and call.args:
        device = call.args[0]
    return device is not None and names_a_gpu(device)


def shown_move(call: ast.Call) -> str:
    """`.cuda()`, `.to(self.device)`, `device=local_rank`: the move without what is moved."""
    device = keyword(call, "device")
    if device is not None:
        return f"device={source_text(device)}"
    func = call.func
    assert isinstance(func, ast.Attribute)  # moves_to_gpu: `.cuda()` or `.to(...)`
    return f".{func.attr}({', '.join(source_text(a) for a in call.args)})"


def names_a_gpu(device: ast.expr) -> bool:
    text = source_text(device)
    return bool(GPU_DEVICE.search(text)) and "cpu" not in text.lower()
