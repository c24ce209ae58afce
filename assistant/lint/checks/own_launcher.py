"""A file that starts its own training workers, and gives them less than torchrun would.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each
worker; a launcher written by hand (`multiprocessing.Process` per GPU,
`mp.spawn`, `subprocess.Popen` of the training script) must set them itself.
One that sets each worker's RANK and WORLD_SIZE but never MASTER_ADDR or
MASTER_PORT leaves init_process_group's env:// rendezvous without its store:
every worker fails with "environment variable MASTER_ADDR expected, but not
set" (launched-without-torchrun).

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

from assistant.lint.model import Script, called_name, keyword, short, source_text
from assistant.lint.registry import check
from assistant.lint.torchapi import init_calls
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
    """The names, attributes, imported modules and strings of the code, but its
    docstrings (which may say what torchrun would do)."""
    docstrings = {
        id(body[0].value)
        for node in [script.tree, *script.nodes]
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    for node in script.nodes:
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.alias):
            yield node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            yield node.value


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
