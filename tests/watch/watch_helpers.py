"""Helpers for the `assistant run` tests: real launches, real /proc checks.

(A module of its own, not conftest.py: test modules import from it, and a
`from conftest import` finds whichever folder's conftest pytest loaded last,
e.g. tests/probing's in `pytest tests/watch tests/probing`.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from assistant.probing.processes import pids_with_env
from assistant.watch.jobhook import WATCH_DIR_VAR

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "scripts"
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2"]


def job_pids(log_dir: Path) -> list[int]:
    """Live processes (not zombies) of the job watched into log_dir, found by its environment."""
    return pids_with_env(WATCH_DIR_VAR, str(Path(log_dir).resolve()))


def no_job_left(log_dir: Path, seconds: float = 5.0) -> bool:
    """Whether every process of the job watched into log_dir is gone within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not job_pids(log_dir):
            return True
        time.sleep(0.1)
    return False


class Output:
    """Collects what the job wrote, with the time of its last byte."""

    def __init__(self):
        self.chunks: list[tuple[str, bytes]] = []
        self.last = time.monotonic()

    def __call__(self, stream: str, data: bytes) -> None:
        self.chunks.append((stream, data))
        self.last = time.monotonic()

    def text(self, stream: str | None = None) -> str:
        return b"".join(d for s, d in self.chunks if stream in (None, s)).decode(errors="replace")
