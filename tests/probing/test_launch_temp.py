"""A probe launch leaves nothing in the user's TMPDIR: a real torchrun, real temp files."""

from __future__ import annotations

import tempfile

import pytest

from assistant.probing.runner import ProbeRunner

pytestmark = pytest.mark.slow

# A versions probe that leaves a temp file and a temp folder behind, as
# libraries do (gloo, torch's caches), and says where its temp folder was.
LITTERING_VERSIONS = '''
"""A versions probe that litters its temp folder (test copy)."""
import sys
import tempfile

from _probekit import main

NAME = "versions"


def collect(ctx):
    tempfile.mkstemp(prefix="left-by-probe-")
    tempfile.mkdtemp(prefix="left-by-probe-")
    return {"tempdir": tempfile.gettempdir()}


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
'''


@pytest.fixture
def littering_probes(probes_with_versions):
    return probes_with_versions(LITTERING_VERSIONS)


@pytest.fixture
def user_temp(tmp_path, monkeypatch):
    """The user's TMPDIR, for this process (tempfile caches it) and what it starts."""
    temp = tmp_path / "user-tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


def test_a_probe_launch_leaves_nothing_in_the_users_tmpdir(littering_probes, user_temp):
    [run] = ProbeRunner(nproc_per_node=2, timeout=120).run(["versions"])
    assert run.status == "ok", run.detail
    # Each rank's temp folder was the launch's own, inside the launch's folder...
    rank_temps = {rank["facts"]["tempdir"] for rank in run.ranks}
    assert len(rank_temps) == 1 and len(run.ranks) == 2
    [rank_temp] = rank_temps
    assert rank_temp.startswith(str(user_temp / "ddp-probes-")) and rank_temp.endswith("/tmp")
    # ...and went with it: no probe litter, no torchrun folder (torchelastic_*), nothing.
    assert list(user_temp.iterdir()) == []
