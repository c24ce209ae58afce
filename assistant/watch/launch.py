"""Reading the user's launch command: its script, its interpreter, its ranks, its environment.

The probes after a failure run the way the user launched: the same Python,
the same number of ranks per node, the same device and distributed
variables. Launch forms understood: `torchrun [opts] train.py`, `python -m
torch.distributed.run [opts] train.py`, `python train.py` (mp.spawn inside),
and any of them behind `srun ...`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

# The user's variables the probes must see as the job did.
PROBE_ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)
PROBE_ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "TORCH_")
NPROC_OPTIONS = ("--nproc_per_node", "--nproc-per-node")
PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")


def script_of(command: list[str], cwd: Path | None = None) -> Path | None:
    """The training script named in the command: its first existing *.py argument."""
    base = Path(cwd or ".")
    for word in command[1:]:
        if word.endswith(".py"):
            path = Path(word) if os.path.isabs(word) else base / word
            if path.is_file():
                return path
    return None


def interpreter_of(command: list[str]) -> str | None:
    """The Python the job runs on: a python word in the command, else torchrun's shebang."""
    for word in command:
        name = os.path.basename(word)
        if PYTHON_NAME.match(name):
            return shutil.which(word) or word
        if name == "torchrun":
            return shebang_python(shutil.which(word) or word)
    return None


def shebang_python(path: str) -> str | None:
    """The interpreter a console script (torchrun) starts with, from its #! line."""
    try:
        with open(path, "rb") as script:
            first = script.readline(512).decode("utf-8", errors="replace")
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[1])
    return words[0]


def nproc_of(command: list[str]) -> int | None:
    """Ranks per node the command asks torchrun for (None when it does not say)."""
    for index, word in enumerate(command):
        for option in NPROC_OPTIONS:
            if word == option and index + 1 < len(command):
                return _count(command[index + 1])
            if word.startswith(option + "="):
                return _count(word.split("=", 1)[1])
    return None


def _count(value: str) -> int | None:
    return int(value) if value.isdigit() and int(value) > 0 else None


def probe_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables of the user's environment that the probes must see too."""
    return {
        name: value
        for name, value in environ.items()
        if name in PROBE_ENV_NAMES or name.startswith(PROBE_ENV_PREFIXES)
    }
