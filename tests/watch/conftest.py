"""Fixtures of the `assistant run` tests (the helpers they import are in watch_helpers)."""

from __future__ import annotations

import pytest
from watch_helpers import Output


@pytest.fixture
def output() -> Output:
    """Collects the watched job's output (an on_output callback)."""
    return Output()
