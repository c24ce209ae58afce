"""Old run log folders are pruned when a run starts, so the cache does not grow forever.

    pruned = prune_old_runs(spare=log_dir)   # never raises
    pruned.removed, pruned.problem

A folder under runs/ stays while it is one of the newest `keep`
(ASSISTANT_RUNS_KEEP, default 20), or was written to within `max_age_days`
(ASSISTANT_RUNS_MAX_AGE_DAYS, default 7), or a run still uses it. A run in
progress holds an flock on its folder for as long as it watches its job
(`lock_run_folder`), so another `assistant run` starting meanwhile skips it;
the lock goes with the process, even one killed by SIGKILL, so no stale
marker can keep a folder forever.

Only real folders named like the ones default_log_dir makes are touched: a
symlink (to a folder or a file), a file, or a folder named otherwise is
left alone, and shutil.rmtree unlinks a symlink found inside a run folder
without following it, so nothing outside runs/ is ever removed.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

KEEP_VAR = "ASSISTANT_RUNS_KEEP"
MAX_AGE_VAR = "ASSISTANT_RUNS_MAX_AGE_DAYS"
DEFAULT_KEEP = 20
DEFAULT_MAX_AGE_DAYS = 7.0
# A folder default_log_dir just made may not hold its lock yet: leave it alone for this long.
JUST_MADE_SECONDS = 60.0
# <YYYYmmdd>-<HHMMSS>-<6 hex>: the only names pruning considers (see default_log_dir).
RUN_FOLDER_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
DAY_SECONDS = 86400.0


@dataclass(frozen=True)
class Retention:
    """Which run folders to keep: the newest `keep`, and all younger than `max_age_days`."""

    keep: int = DEFAULT_KEEP
    max_age_days: float = DEFAULT_MAX_AGE_DAYS


@dataclass
class Pruned:
    """What one pruning did: the folders removed, and the first thing that went wrong."""

    removed: list[Path] = field(default_factory=list)
    problem: str | None = None  # one line for the person; pruning never fails the run


class SettingError(ValueError):
    """A retention variable that is not a number pruning can use."""


def retention_from_env() -> Retention:
    """The retention the environment asks for; SettingError for a value that is not a number."""
    keep = _setting(KEEP_VAR, DEFAULT_KEEP, int, "a whole number")
    age = _setting(MAX_AGE_VAR, DEFAULT_MAX_AGE_DAYS, float, "a number of days")
    return Retention(keep=keep, max_age_days=age)


def _setting(name: str, default, kind: type, what: str):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = -1
    if not value >= 0:  # negative, or NaN (no comparison holds for NaN)
        raise SettingError(f"{name}={text} is not {what} of 0 or more")
    return value


# --- the lock a run in progress holds ------------------------------------------------


class RunLock:
    """An flock held on a run folder while its job is watched (see the module docstring)."""

    def __init__(self, descriptor: int):
        self.descriptor = descriptor

    def release(self) -> None:
        """Let pruning have the folder (closing the descriptor drops the lock)."""
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1


def lock_run_folder(folder: Path) -> RunLock | None:
    """Hold an exclusive lock on `folder` (None where flock does not work there)."""
    try:
        descriptor = open_folder(folder)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return None
    return RunLock(descriptor)


def open_folder(folder: Path) -> int:
    """A descriptor of `folder` itself; OSError when it is a symlink or not a folder."""
    # O_CLOEXEC: the user's job must not inherit (and so extend) the lock.
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(folder, flags)


# --- pruning ---------------------------------------------------------------------------


def runs_dir() -> Path:
    """Where `assistant run` keeps a folder per run by default (in the user's cache)."""
    from assistant.config import user_cache_dir

    return user_cache_dir() / "runs"


def prune_old_runs(spare: Path | None = None) -> Pruned:
    """Prune runs_dir() as the environment asks; a bad setting or a failure is `problem`."""
    try:
        retention = retention_from_env()
    except SettingError as exc:
        return Pruned(problem=f"{exc}; old run logs were kept")
    try:
        return prune_runs(runs_dir(), retention, spare)
    except Exception as exc:  # noqa: BLE001 - pruning must never fail the run it precedes
        return Pruned(problem=f"old run logs were not pruned: {exc}")


def prune_runs(runs: Path, retention: Retention, spare: Path | None = None) -> Pruned:
    """Remove the run folders under `runs` that the retention lets go; never raises.

    `spare`: a folder never removed (the run starting now).
    """
    pruned = Pruned()
    now = time.time()
    spare = spare.resolve() if spare is not None else None
    try:
        runs = runs.resolve()  # a runs/ that is itself a symlink is the person's choice
        folders = run_folders(runs)
    except OSError as exc:
        pruned.problem = f"cannot read {runs}: {exc.strerror or exc}"
        return pruned
    by_activity = sorted(folders, key=lambda item: item[1], reverse=True)
    oldest_kept = now - retention.max_age_days * DAY_SECONDS
    for folder, active in by_activity[retention.keep :]:
        if active >= oldest_kept or now - active < JUST_MADE_SECONDS or folder == spare:
            continue
        problem = remove_unless_in_use(folder)
        if problem is None:
            pruned.removed.append(folder)
        elif pruned.problem is None and problem:
            pruned.problem = problem
    return pruned


def run_folders(runs: Path) -> list[tuple[Path, float]]:
    """(folder, last written) of each real run folder directly under `runs`."""
    if not runs.is_dir():
        return []
    found = []
    with os.scandir(runs) as entries:
        for entry in entries:
            if not RUN_FOLDER_NAME.match(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            found.append((Path(entry.path), last_written(Path(entry.path))))
    return found


def last_written(folder: Path) -> float:
    """When the run last wrote: its folder, its output log or its procs/ folder changed."""
    times = []
    for path in (folder, folder / "output.log", folder / "procs"):
        try:
            info = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode):
            times.append(info.st_mtime)
    return max(times, default=0.0)


def remove_unless_in_use(folder: Path) -> str | None:
    """Remove a run folder nobody holds; None when removed, '' when in use, else the problem."""
    try:
        descriptor = open_folder(folder)
    except OSError:
        return ""  # gone already (another run pruned it), or swapped for a symlink: leave it
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return ""  # a run in progress holds it
        # Held while removing, so a second pruner skips it rather than racing.
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"cannot remove {folder}: {exc.strerror or exc}"
        return None
    finally:
        os.close(descriptor)
