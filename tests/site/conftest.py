"""Fixtures of the KB site tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from kbsite_hostile import make_hostile_team


@pytest.fixture
def hostile_team(tmp_path) -> Path:
    """A team folder with a cause and a thread whose every text carries HTML or script."""
    return make_hostile_team(tmp_path / "team")
