"""The watch tests collect beside the probing tests, in either order, in one pytest call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "folders", [["tests/watch", "tests/probing"], ["tests/probing", "tests/watch"]]
)
def test_watch_and_probing_tests_collect_together(folders):
    # Both folders have a conftest.py; a test module that imported names from
    # `conftest` got whichever of the two pytest had loaded last.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            *folders,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-3000:]
    assert "tests/watch/test_watch_cli.py::" in done.stdout
