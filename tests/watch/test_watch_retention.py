"""Old run log folders are pruned when a run starts: real folders, real locks, real runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from watch_helpers import PYTHON

from assistant.cli import main
from assistant.watch.retention import (
    KEEP_VAR,
    MAX_AGE_VAR,
    Retention,
    lock_run_folder,
    prune_runs,
    runs_dir,
)

DAY = 86400.0

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="flock and O_NOFOLLOW folders")


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    """The runs folder of a private cache (the person's own cache is never touched)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(KEEP_VAR, raising=False)
    monkeypatch.delenv(MAX_AGE_VAR, raising=False)
    folder = runs_dir()
    folder.mkdir(parents=True)
    return folder


def make_run(runs: Path, number: int, age_days: float) -> Path:
    """A finished run folder as `assistant run` leaves it, last written `age_days` ago."""
    folder = runs / f"20260101-{number:06d}-{number:06x}"
    (folder / "procs").mkdir(parents=True)
    (folder / "output.log").write_text(f"run {number}\n")
    return last_written(folder, age_days)


def last_written(folder: Path, age_days: float) -> Path:
    """Make the run folder look last written `age_days` ago."""
    when = time.time() - age_days * DAY
    for path in (folder / "output.log", folder / "procs", folder):
        os.utime(path, (when, when))
    return folder


def names(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


def test_the_newest_and_the_young_stay_and_nothing_outside_runs_is_touched(runs, tmp_path):
    old = [make_run(runs, n, age_days=30 + n) for n in range(25)]  # old[0] is the newest
    young = [make_run(runs, 100 + n, age_days=2) for n in range(3)]
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious.txt").write_text("mine")
    # A run folder holding a symlink out of runs/: the link goes, its target stays.
    os.symlink(outside / "keep", old[-1] / "link-out")
    last_written(old[-1], 30 + 24)
    # Named like a run but a symlink (to a folder outside), or a file: never removed.
    os.symlink(outside, runs / "20250101-000000-aaaaaa")
    (runs / "20250101-000000-bbbbbb").write_text("a file")
    other = runs / "my-notes"
    other.mkdir()
    os.utime(other, (0, 0))

    pruned = prune_runs(runs, Retention(keep=20, max_age_days=7))

    kept = names(runs)
    # The 3 young ones are among the newest 20, so 17 old ones stay with them.
    assert {f.name for f in young} <= kept
    assert {f.name for f in old[:17]} <= kept
    assert not kept & {f.name for f in old[17:]}
    assert sorted(pruned.removed) == sorted(old[17:]) and pruned.problem is None
    assert {"20250101-000000-aaaaaa", "20250101-000000-bbbbbb", "my-notes"} <= kept
    assert (outside / "keep" / "precious.txt").read_text() == "mine"


def test_a_folder_locked_by_a_run_in_progress_is_kept(runs):
    busy, idle = make_run(runs, 1, age_days=30), make_run(runs, 2, age_days=30)
    # The lock is an flock of another process, as a second `assistant run` would hold it.
    holder = subprocess.Popen(
        [
            PYTHON,
            "-c",
            (
                "import sys, time; from assistant.watch.retention import lock_run_folder;"
                "lock = lock_run_folder(sys.argv[1]); print(lock is not None, flush=True);"
                "time.sleep(60)"
            ),
            str(busy),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        pruned = prune_runs(runs, Retention(keep=0, max_age_days=0))
        assert pruned.removed == [idle] and busy.is_dir()
    finally:
        holder.kill()
        holder.wait()
    # The lock goes with its process (even a killed one): then the folder can go too.
    assert prune_runs(runs, Retention(keep=0, max_age_days=0)).removed == [busy]


def test_a_lock_is_released_and_a_second_one_is_refused(runs):
    folder = make_run(runs, 1, age_days=30)
    first = lock_run_folder(folder)
    assert first is not None and lock_run_folder(folder) is None
    first.release()
    second = lock_run_folder(folder)
    assert second is not None
    second.release()
    os.symlink(folder, runs / "20260101-999999-ffffff")
    assert lock_run_folder(runs / "20260101-999999-ffffff") is None  # never through a symlink


def test_a_folder_that_cannot_be_removed_is_one_problem_and_the_rest_still_goes(runs):
    if shutil.which("chattr") is None or os.geteuid() != 0:
        pytest.skip("needs chattr and root to make a file that cannot be removed")
    stuck, other = make_run(runs, 1, age_days=30), make_run(runs, 2, age_days=31)
    pinned = stuck / "procs" / "pinned"
    pinned.write_text("x")
    last_written(stuck, 30)
    if subprocess.run(["chattr", "+i", str(pinned)], check=False).returncode != 0:
        pytest.skip("this file system has no immutable flag")
    try:
        pruned = prune_runs(runs, Retention(keep=0, max_age_days=0))
    finally:
        subprocess.run(["chattr", "-i", str(pinned)], check=True)
    assert pruned.removed == [other]
    assert pruned.problem.startswith(f"cannot remove {stuck}") and "\n" not in pruned.problem


def run_cli(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["run", *args, "--", PYTHON, "-c", "print('trained')"], env=env)


def test_assistant_run_says_where_its_logs_are_and_prunes_the_cache(runs):
    for number in range(22):
        make_run(runs, number, age_days=10 + number)
    result = run_cli([])
    assert result.exit_code == 0, result.output
    new = [path for path in runs.iterdir() if not path.name.startswith("20260101-")]
    assert len(new) == 1 and (new[0] / "output.log").read_text() == "trained\n"
    assert f"assistant run: logs in {new[0]}" in result.stderr
    # Said before the job's output, so a long job's logs can be followed while it runs.
    assert result.output.index("logs in") < result.output.index("trained")
    assert len(list(runs.iterdir())) == 20  # the new run and the 19 newest of the old


def test_the_retention_comes_from_the_environment(runs):
    for number in range(5):
        make_run(runs, number, age_days=1 + number)
    result = run_cli([], env={KEEP_VAR: "2", MAX_AGE_VAR: "0.5"})
    assert result.exit_code == 0, result.output
    kept = sorted(names(runs))
    assert len(kept) == 2 and "20260101-000000-000000" in kept  # the new run and the newest old


@pytest.mark.parametrize(("name", "value"), [(KEEP_VAR, "many"), (MAX_AGE_VAR, "-3")])
def test_a_bad_setting_is_one_line_keeps_everything_and_the_run_goes_on(runs, name, value):
    for number in range(25):
        make_run(runs, number, age_days=30)
    result = run_cli([], env={name: value})
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if name in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"assistant run: {name}={value} is not")
    assert warnings[0].endswith("; old run logs were kept") and "Traceback" not in result.output
    assert len(list(runs.iterdir())) == 26


def test_a_log_dir_given_by_the_person_leaves_the_cache_alone(runs, tmp_path):
    for number in range(25):
        make_run(runs, number, age_days=30)
    result = run_cli(["--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == 0, result.output
    assert f"logs in {tmp_path / 'logs'}" in result.stderr
    assert len(list(runs.iterdir())) == 25


def test_a_folder_made_a_moment_ago_is_kept_though_it_holds_no_lock_yet(runs):
    # default_log_dir's folder exists a moment before its run locks it.
    fresh, old = make_run(runs, 1, age_days=0), make_run(runs, 2, age_days=30)
    assert prune_runs(runs, Retention(keep=0, max_age_days=0)).removed == [old]
    assert fresh.is_dir()
