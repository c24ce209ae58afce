"""The fixture every torchrun test relies on: a launch that hangs is killed whole
(the workers too, though torchrun starts them in sessions of their own), says what
was still alive, and a twin that only hung or crashed in its teardown is told apart."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs

from assistant.probing.processes import pids_with_marker

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"

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


# Rank 0 aborts at its end the first time (as a gloo rank sometimes did in the
# interpreter's teardown), not once the folder holds the first run's marker.
ABORTS_THE_FIRST_TIME = (
    "import os, pathlib\n"
    'print("trained", flush=True)\n'
    'marker = pathlib.Path("aborted-once")\n'
    'if os.environ["RANK"] == "0" and not marker.exists():\n'
    "    marker.touch()\n"
    "    os.abort()\n"
)
# A bus error the first time (CI saw a gloo rank die of SIGBUS, exit code -7).
BUS_ERROR_THE_FIRST_TIME = ABORTS_THE_FIRST_TIME.replace(
    "os.abort()", "import signal; os.kill(os.getpid(), signal.SIGBUS)"
)
ALWAYS_ABORTS = 'import os\nprint("trained", flush=True)\nos.abort()\n'
# What gloo's size check does on a collective mismatch: a thrown error, not a crash.
THROWS_THEN_ABORTS = (
    "import os, sys\n"
    "sys.stderr.write(\"terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n\")\n"
    "sys.stderr.flush()\n"
    "os.abort()\n"
)


@pytest.mark.slow
def test_a_run_whose_rank_crashed_is_launched_once_more_with_a_warning(torchrun, tmp_path):
    files = scripts(tmp_path, flaky=ABORTS_THE_FIRST_TIME, crashes=ALWAYS_ABORTS)
    with pytest.warns(torchrun.RankCrashed, match="flaky.py: a rank crashed") as caught:
        flaky = torchrun.start(files["flaky"])()
    assert flaky.returncode == 0, flaky.stderr[-2000:]
    assert flaky.stdout.count("trained") == 2
    assert "Fatal Python error: Aborted" in str(caught[0].message)  # faulthandler's stack
    with pytest.warns(torchrun.RankCrashed, match="crashes.py"):
        crashes = torchrun.start(files["crashes"])()
    assert crashes.returncode != 0
    assert len(torchrun.launched) == 4  # each launched twice, no more


@pytest.mark.slow
def test_a_run_whose_rank_died_of_a_bus_error_is_launched_once_more(torchrun, tmp_path):
    files = scripts(tmp_path, bus=BUS_ERROR_THE_FIRST_TIME)
    with pytest.warns(torchrun.RankCrashed, match="bus.py: a rank crashed"):
        ran = torchrun.start(files["bus"])()
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.count("trained") == 2
    assert len(torchrun.launched) == 2


@pytest.mark.slow
def test_a_rank_that_aborts_on_an_error_it_threw_is_not_launched_again(torchrun, tmp_path):
    files = scripts(tmp_path, throws=THROWS_THEN_ABORTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchrun.RankCrashed)
        thrown = torchrun.start(files["throws"])()
    assert thrown.returncode != 0
    assert len(torchrun.launched) == 1


# Both ranks print their line, then rank 0 aborts each time (the first run and
# its rerun): the teardown crash CI saw twice in a row on one twin.
TRAINS_THEN_ALWAYS_ABORTS = (
    'import os\nprint("trained", flush=True)\nif os.environ["RANK"] == "0":\n    os.abort()\n'
)
# Rank 0 aborts before it prints: the twin did not train on every rank.
ABORTS_BEFORE_ONE_RANK_TRAINS = (
    'import os\nif os.environ["RANK"] == "0":\n    os.abort()\nprint("trained", flush=True)\n'
)


@pytest.mark.slow
def test_a_twin_that_crashed_only_in_its_teardown_twice_is_marked_xfail(torchrun, tmp_path):
    files = scripts(tmp_path, broken=FAILS, twin=TRAINS_THEN_ALWAYS_ABORTS)
    with pytest.warns(torchrun.RankCrashed), pytest.raises(pytest.xfail.Exception) as outcome:
        assert_broken_fails_and_twin_runs(
            torchrun, files["broken"], "the broken fixture failed", files["twin"], "trained"
        )
    assert "crashed at exit" in str(outcome.value)
    assert "SIGABRT" in str(outcome.value)
    assert len(torchrun.launched) == 3  # the broken once, the twin twice


@pytest.mark.slow
def test_a_twin_that_crashed_before_every_rank_trained_fails(torchrun, tmp_path):
    files = scripts(tmp_path, broken=FAILS, twin=ABORTS_BEFORE_ONE_RANK_TRAINS)
    with pytest.warns(torchrun.RankCrashed), pytest.raises(AssertionError):
        assert_broken_fails_and_twin_runs(
            torchrun, files["broken"], "the broken fixture failed", files["twin"], "trained"
        )


def ddp_kept_past_destroy(source: str) -> list[int]:
    """Lines of `destroy_process_group()` calls with a DDP of the same function
    (`model = DDP(...)` in its body) not deleted before them."""
    tree = ast.parse(source)
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        wrapped: set[str] = set()
        for statement in function.body:
            if isinstance(statement, ast.Assign) and wraps_in_ddp(statement.value):
                wrapped |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
            elif isinstance(statement, ast.Delete):
                wrapped -= {t.id for t in statement.targets if isinstance(t, ast.Name)}
            elif destroys_the_group(statement) and wrapped:
                found.append(statement.lineno)
    return found


def wraps_in_ddp(value: ast.expr) -> bool:
    func = value.func if isinstance(value, ast.Call) else None
    name = getattr(func, "id", None) or getattr(func, "attr", None)
    return name in ("DDP", "DistributedDataParallel")


def destroys_the_group(statement: ast.stmt) -> bool:
    call = statement.value if isinstance(statement, ast.Expr) else None
    func = call.func if isinstance(call, ast.Call) else None
    return (getattr(func, "attr", None) or getattr(func, "id", None)) == "destroy_process_group"


def test_every_fixture_frees_ddp_before_destroying_its_group():
    """tests/data/scripts/README.md: DDP freed after its group made ranks abort or
    hang at exit on a loaded machine, after the line a test reads."""
    kept = {
        path.name: lines
        for path in sorted(SCRIPTS.glob("*.py"))
        if (lines := ddp_kept_past_destroy(path.read_text()))
    }
    assert kept == {}


def test_the_rule_sees_a_ddp_kept_and_one_freed():
    kept = "def main():\n    model = DDP(net)\n    train(model)\n    dist.destroy_process_group()\n"
    freed = kept.replace("    dist.destroy", "    del model\n    dist.destroy")
    assert ddp_kept_past_destroy(kept) == [4]
    assert ddp_kept_past_destroy(freed) == []
