"""Fixtures of the `assistant run` tests (the helpers they import are in watch_helpers)."""

from __future__ import annotations

import pytest
from watch_helpers import Output


@pytest.fixture
def output() -> Output:
    """Collects the watched job's output (an on_output callback)."""
    return Output()


@pytest.fixture(autouse=True)
def jobs_temp(tmp_path_factory, monkeypatch):
    """A TMPDIR for the jobs these tests launch, inside pytest's own temp folder.

    `assistant run` leaves the user's TMPDIR as it is (their job may depend on
    it), so every torchrun it starts makes torchrun's default log folder
    (torchelastic_*) there, as torchrun does without us. The tests' jobs
    make it here rather than in the machine's /tmp.
    """
    temp = tmp_path_factory.mktemp("jobs-tmp")
    monkeypatch.setenv("TMPDIR", str(temp))
    return temp
