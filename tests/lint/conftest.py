"""Running a lint fixture for real: what a check reports must be what the script does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def torchrun(tmp_path: Path) -> Callable[[Path], subprocess.CompletedProcess]:
    """`torchrun --standalone --nproc_per_node=2 SCRIPT` on gloo CPU ranks.

    --standalone lets the rendezvous pick its own free port: a port chosen here
    and released before torchrun binds it can be taken by a parallel test.
    """

    def run(script: Path) -> subprocess.CompletedProcess:
        logs = tmp_path / f"torchelastic-{script.stem}"
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                f"--log_dir={logs}",
                str(script),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    return run
