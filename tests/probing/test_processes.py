"""assistant.probing.processes: real processes, real signals, no fakes.

A "launch" here is a python that starts a grandchild in a session of its
own (as torchrun does with its workers), so only the marker can find it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from assistant.probing import processes
from assistant.probing.processes import (
    MARKER_VAR,
    Terminated,
    kill_marked,
    pids_with_marker,
    start_marked,
    tracked_folder,
)

pytestmark = pytest.mark.skipif(not processes.has_proc(), reason="needs /proc")

# A parent that starts a grandchild in its own session and ignores SIGTERM,
# as a stubborn launcher would; both sleep until killed.
LAUNCHER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                     start_new_session=True)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def wait_for(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_marked_tree_is_found_and_killed_even_when_it_ignores_sigterm():
    marked = start_marked([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE)
    try:
        assert marked.process.stdout.readline().strip() == b"ready"
        assert wait_for(lambda: len(marked.pids()) == 2)
        assert marked.marker in processes.live_markers()
        started = time.monotonic()
        marked.stop(grace=0.5)
        assert time.monotonic() - started < 8
        assert pids_with_marker(marked.marker) == []
        assert marked.poll() is not None
        assert marked.marker not in processes.live_markers()
    finally:
        kill_marked(marked.marker, grace=0.1, process=marked.process)


def test_marker_reaches_the_environment_and_only_that_launch_is_listed():
    marked = start_marked(
        [sys.executable, "-c", f"import os; print(os.environ['{MARKER_VAR}'])"],
        stdout=subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "")},
    )
    out, _ = marked.process.communicate(timeout=30)
    assert out.decode().strip() == marked.marker
    assert pids_with_marker(marked.marker) == []
    assert pids_with_marker("no-such-marker") == []
    marked.stop()


def test_tracked_folder_is_removed_on_exit():
    with tracked_folder("ddp-test-") as folder:
        (folder / "x").write_text("1")
        assert folder.is_dir()
    assert not folder.exists()


def test_terminated_carries_the_shell_exit_code():
    assert Terminated(signal.SIGTERM).exit_code == 143
    assert Terminated(signal.SIGHUP).exit_code == 129


# A command under signals_raise(): a launch started from a worker thread,
# a tracked folder; the test signals it and checks what is left. SIGHUP is
# set back to its default, as from a terminal: a runner started under nohup
# leaves it ignored, and signals_raise() rightly keeps an ignored SIGHUP so.
GUARDED = textwrap.dedent(
    """
    import signal, sys, threading, time
    from assistant.probing import processes
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    LAUNCHER = {launcher!r}

    def worker(folder_holder):
        with processes.tracked_folder("ddp-test-") as folder:
            folder_holder.append(folder)
            marked = processes.start_marked([sys.executable, "-c", LAUNCHER])
            print("marker", marked.marker, folder, flush=True)
            while not processes.stop_requested():
                time.sleep(0.05)

    try:
        with processes.signals_raise():
            holder = []
            threading.Thread(target=worker, args=(holder,), daemon=True).start()
            time.sleep(600)
    except processes.Terminated as exc:
        print("terminated", exc.exit_code, flush=True)
        sys.exit(exc.exit_code)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_in_main_thread_cleans_up_a_launch_of_a_worker_thread(sig):
    script = GUARDED.format(launcher=LAUNCHER)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        _, marker, folder = child.stdout.readline().split()
        assert wait_for(lambda: len(pids_with_marker(marker)) == 2)
        child.send_signal(sig)
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 128 + sig
    assert f"terminated {128 + sig}" in out
    assert pids_with_marker(marker) == []
    assert not Path(folder).exists()


def test_an_ignored_sighup_stays_ignored():
    """nohup: the person asked the command to survive a closed terminal."""
    script = (
        "import signal, time\n"
        "from assistant.probing import processes\n"
        "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "with processes.signals_raise():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(1.5)\n"
        "print('survived', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGHUP)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and "survived" in out


def test_a_command_that_cannot_start_is_an_oserror_and_not_registered():
    before = set(processes.registered_markers())
    with pytest.raises(OSError):
        start_marked(["/no/such/program"])
    assert set(processes.registered_markers()) == before


# Code that swallows every exception (a library's `except BaseException`, a
# C callback): the Terminated never reaches signals_raise().
SWALLOWING = textwrap.dedent(
    """
    import sys, time
    from assistant.probing import processes
    LAUNCHER = {launcher!r}

    with processes.signals_raise():
        marked = processes.start_marked([sys.executable, "-c", LAUNCHER])
        print(marked.marker, flush=True)
        for _ in range(600):
            try:
                time.sleep(0.1)
            except BaseException:
                pass
    print("carried on", flush=True)
    """
)


def test_a_swallowed_terminated_still_cleans_up_and_exits():
    child = subprocess.Popen(
        [sys.executable, "-c", SWALLOWING.format(launcher=LAUNCHER)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        marker = child.stdout.readline().strip()
        assert wait_for(lambda: len(pids_with_marker(marker)) == 2)
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 143 and "carried on" not in out
    assert "terminated by SIGTERM" in err
    assert processes.ESCAPE_SECONDS <= time.monotonic() - started < processes.ESCAPE_SECONDS + 15
    assert pids_with_marker(marker) == []
