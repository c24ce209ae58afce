"""The fixture every torchrun test relies on: a launch that hangs is killed whole
(the workers too, though torchrun starts them in sessions of their own), says what
was still alive, and a twin that only hung in its teardown is told apart."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs

from assistant.probing.processes import pids_with_marker

FAILS = 'raise SystemExit("the broken fixture failed")\n'
# Both ranks print their line, as a twin that trained does, then never exit.
TRAINS_THEN_HANGS = 'import time\nprint("trained", flush=True)\ntime.sleep(600)\n'
# Only rank 1 prints: the twin did not train on every rank.
ONE_RANK_TRAINS_THEN_HANGS = (
    "import os, time\n"
    'if os.environ["RANK"] == "1":\n'
    '    print("trained", flush=True)\n'
    "time.sleep(600)\n"
)


def scripts(folder: Path, **sources: str) -> dict[str, Path]:
    paths = {}
    for name, source in sources.items():
        paths[name] = folder / f"{name}.py"
        paths[name].write_text(source)
    return paths


@pytest.mark.slow
def test_a_twin_hung_only_in_its_teardown_is_killed_whole_and_marked_xfail(torchrun, tmp_path):
    files = scripts(tmp_path, broken=FAILS, twin=TRAINS_THEN_HANGS)
    torchrun.timeout_s = 12  # the workers import nothing: they print within seconds
    with pytest.raises(pytest.xfail.Exception) as outcome:
        assert_broken_fails_and_twin_runs(
            torchrun, files["broken"], "the broken fixture failed", files["twin"], "trained"
        )
    assert "twin.py" in str(outcome.value)  # what was alive: the two workers at least
    assert str(outcome.value).count("twin.py") >= 2
    assert all(pids_with_marker(launch.marker) == [] for launch in torchrun.launched)


@pytest.mark.slow
def test_a_twin_that_hung_before_every_rank_trained_fails(torchrun, tmp_path):
    files = scripts(tmp_path, broken=FAILS, twin=ONE_RANK_TRAINS_THEN_HANGS)
    torchrun.timeout_s = 12
    with pytest.raises(torchrun.Hung) as hung:
        assert_broken_fails_and_twin_runs(
            torchrun, files["broken"], "the broken fixture failed", files["twin"], "trained"
        )
    assert hung.value.stdout.count("trained") == 1
    assert all(pids_with_marker(launch.marker) == [] for launch in torchrun.launched)
