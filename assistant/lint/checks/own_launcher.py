"""A file that starts its own training workers, and gives them less than torchrun would.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each
worker; a launcher written by hand (`multiprocessing.Process` per GPU,
`mp.spawn`, `subprocess.Popen` of the training script) must set them itself.
One that sets each worker's RANK and WORLD_SIZE but never MASTER_ADDR or
MASTER_PORT leaves init_process_group's env:// rendezvous without its store:
every worker fails with "environment variable MASTER_ADDR expected, but not
set" (launched-without-torchrun).

And a launcher that gives each worker one GPU through CUDA_VISIBLE_DEVICES (the
element of a list of GPUs, a rank): inside the worker that GPU is cuda:0, the
only one it sees; a worker that still picks its device by its rank
(`torch.cuda.set_device(local_rank)`, `device_ids=[local_rank]`) asks rank 1
for a second GPU it cannot see: "CUDA error: invalid device ordinal"
(cuda-visible-devices-mismatch).

Only a file that shows both sides is judged: its own start of the workers and
their init_process_group with the env:// rendezvous (no init_method, no store),
with no word of MASTER_ADDR or MASTER_PORT anywhere, and no launcher that sets
them (torchrun or torch.distributed.run called from the file, DeepSpeed,
Accelerate, submitit).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from assistant.lint.checks.data import words_in
from assistant.lint.model import Script, called_name, keyword, short, source_text
from assistant.lint.ranks import is_rank_expr
from assistant.lint.registry import check
from assistant.lint.torchapi import init_calls, visible_device_settings
from assistant.results import Finding

# Calls that start worker processes of the file's own.
WORKER_STARTS = frozenset({"Process", "spawn", "start_processes", "Popen"})
# What else in the file would set the rendezvous's variables.
OTHER_LAUNCHERS = re.compile(
    r"torchrun|torch\.distributed\.(?:run|launch)|elastic_launch|LaunchConfig|deepspeed"
    r"|accelerate|submitit|MASTER_ADDR|MASTER_PORT|MPI|mpi4py|horovod"
)
RANK_VARIABLES = frozenset({"RANK", "WORLD_SIZE"})


@check("launched-without-torchrun")
def check_own_launcher_without_the_master(script: Script) -> Iterator[Finding]:
    """Workers started by the file with RANK / WORLD_SIZE but no MASTER_ADDR / MASTER_PORT,
    joined over env://."""
    if any(OTHER_LAUNCHERS.search(word) for word in code_words(script)):
        return
    starts = [node for node, name in script.call_names if short(name) in WORKER_STARTS]
    if not starts or not sets_rank_variables(script):
        return
    for init in init_calls(script):
        if short(script.name_of(init.func)) != "init_process_group" or not env_rendezvous(init):
            continue
        start = starts[0]
        yield script.finding(
            "launched-without-torchrun",
            init,
            "init_process_group joins over env://, which reads MASTER_ADDR and MASTER_PORT "
            f"from the environment; torchrun would set them, but this file starts the "
            f"workers itself ({source_text(start.func)}, line {start.lineno}) and gives them "
            'RANK and WORLD_SIZE only: every worker fails with "environment variable '
            'MASTER_ADDR expected, but not set"; set MASTER_ADDR and MASTER_PORT in each '
            'worker\'s environment (one port, chosen by the launcher), or pass init_method="tcp://HOST:PORT"',
        )


def code_words(script: Script) -> Iterator[str]:
    """The code's identifiers and strings (data.words_in) and the modules it imports,
    but its docstrings (which may say what torchrun would do)."""
    docstrings = {
        body[0].value.value
        for node in [script.tree, *script.nodes]
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    yield from (word for word in words_in(script.tree) if word not in docstrings)
    for node in script.nodes:
        if isinstance(node, ast.alias):
            yield node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg


def env_rendezvous(init: ast.Call) -> bool:
    """No init_method (or "env://") and no store: the rendezvous reads the environment."""
    if keyword(init, "store") is not None:
        return False
    method = keyword(init, "init_method")
    if method is None:
        return len(init.args) < 2  # init_process_group(backend, init_method, ...)
    return isinstance(method, ast.Constant) and method.value == "env://"


def sets_rank_variables(script: Script) -> bool:
    """The file writes RANK or WORLD_SIZE into an environment: `os.environ["RANK"] =`,
    `env.update(RANK=...)`, `{"RANK": str(rank), ...}`."""
    for node in script.nodes:
        if isinstance(node, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value in RANK_VARIABLES for k in node.keys
        ):
            return True
        if isinstance(node, ast.Call) and called_name(node) in {"update", "setdefault", "dict"}:
            if any(k.arg in RANK_VARIABLES for k in node.keywords):
                return True
            if called_name(node) == "setdefault" and node.args and is_rank_key(node.args[0]):
                return True
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and is_rank_key(t.slice) for t in targets):
                return True
    return False


def is_rank_key(key: ast.expr) -> bool:
    return isinstance(key, ast.Constant) and key.value in RANK_VARIABLES


@check("cuda-visible-devices-mismatch")
def check_one_visible_gpu_picked_by_rank(script: Script) -> Iterator[Finding]:
    """Each worker given one GPU through CUDA_VISIBLE_DEVICES, then its device picked by rank."""
    pinned = [node for node, value in visible_device_settings(script) if one_gpu(script, value)]
    if not pinned:
        return
    picks = sorted(devices_picked_by_rank(script), key=lambda pick: pick[0].lineno)
    if not picks:
        return
    (node, index), others = picks[0], sorted({pick.lineno for pick, _ in picks[1:]})
    also = f" (and again on line{'s' * (len(others) > 1)} {', '.join(map(str, others))})"
    yield script.finding(
        "cuda-visible-devices-mismatch",
        node,
        f"CUDA_VISIBLE_DEVICES gives each worker one GPU (line {pinned[0].lineno}), which "
        f"the worker sees as cuda:0, its only device; picking the device by "
        f"{source_text(index)}{also if others else ''} asks every rank but the first for a "
        'GPU it cannot see ("CUDA error: invalid device ordinal"); use device 0 in the '
        "worker, or give every worker all the GPUs and keep picking by the local rank",
    )


def one_gpu(script: Script, value: ast.expr) -> bool:
    """The value names one GPU: an element of a list (`gpu` of `for gpu in gpus`,
    `gpus[i]`), a rank, or either as a string (`str(gpu)`, `f"{gpu}"`)."""
    if isinstance(value, ast.Call) and called_name(value) == "str" and len(value.args) == 1:
        return one_gpu(script, value.args[0])
    if isinstance(value, ast.JoinedStr):
        parts = [v for v in value.values if isinstance(v, ast.FormattedValue)]
        texts = "".join(v.value for v in value.values if isinstance(v, ast.Constant))
        return len(parts) == 1 and "," not in texts and one_gpu(script, parts[0].value)
    if isinstance(value, ast.Subscript):
        return not isinstance(value.slice, ast.Slice)
    if isinstance(value, ast.Name):
        return is_rank_expr(value, script) or is_loop_element(script, value.id)
    return is_rank_expr(value, script)


def is_loop_element(script: Script, name: str) -> bool:
    """`name` is what a loop takes from a list one at a time: `for gpu in gpus`,
    `for i, gpu in enumerate(gpus)`, `for gpu, port in zip(gpus, ports)`."""
    for node in script.of_type(ast.For | ast.comprehension):
        targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return not (isinstance(node.iter, ast.Call) and called_name(node.iter) == "range")
    return False


def devices_picked_by_rank(script: Script) -> Iterator[tuple[ast.AST, ast.expr]]:
    """(where, the rank) of each device picked by a rank: `set_device(local_rank)`,
    `device_ids=[local_rank]`, `torch.device("cuda", local_rank)`, f"cuda:{local_rank}"."""
    for node, name in script.call_names:
        if short(name) == "set_device" and node.args and is_rank_expr(node.args[0], script):
            yield node, node.args[0]
        ids = keyword(node, "device_ids")
        if isinstance(ids, ast.List) and len(ids.elts) == 1 and is_rank_expr(ids.elts[0], script):
            yield node, ids.elts[0]
        if (
            short(name) == "device"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "cuda"
            and is_rank_expr(node.args[1], script)
        ):
            yield node, node.args[1]
    for node in script.of_type(ast.JoinedStr):
        if cuda_prefix(node):
            picked = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
            if len(picked) == 1 and is_rank_expr(picked[0], script):
                yield node, picked[0]


def cuda_prefix(text: ast.JoinedStr) -> bool:
    first = text.values[0] if text.values else None
    return isinstance(first, ast.Constant) and first.value == "cuda:"
