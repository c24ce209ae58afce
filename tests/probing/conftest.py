"""Fixtures of the probing tests: a probe folder with a probe that hangs."""

from __future__ import annotations

import shutil
import textwrap

import pytest

from assistant.config import PROJECT_ROOT

HANGING_VERSIONS = '''
"""A versions probe that hangs (test copy)."""
import sys
import time

from _probekit import main

NAME = "versions"


def collect(ctx):
    ctx.checkpoint({"before_hang": True, "step": "sleeping"})
    time.sleep(3600)
    return {}


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
'''


@pytest.fixture
def probes_with_versions(tmp_path, monkeypatch):
    """Make a copy of probes/ whose versions probe is `source`, used by every launch (env)."""

    def make(source: str):
        folder = tmp_path / "probes"
        shutil.copytree(
            PROJECT_ROOT / "probes", folder, ignore=shutil.ignore_patterns("__pycache__")
        )
        (folder / "versions.py").write_text(textwrap.dedent(source))
        monkeypatch.setenv("ASSISTANT_PROBES", str(folder))
        return folder

    return make


@pytest.fixture
def hanging_probes(probes_with_versions):
    """A copy of probes/ whose versions probe hangs after saving a partial fact."""
    return probes_with_versions(HANGING_VERSIONS)
