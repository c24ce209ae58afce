"""Fixtures shared by the chat's Pilot tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend():
    """Textual runs on asyncio: the `pytest.mark.anyio` tests here use only that backend."""
    return "asyncio"
