"""Hostile signals to the real `assistant` command while torchrun's ranks run.

SIGTERM (timeout, kill) and SIGHUP (the terminal closed) must clean up like
Ctrl-C: every process of the launch killed, the temp folders removed, and
the exit code a shell reports for the signal (128 + signum). The probe
folder is a copy whose versions probe hangs, so the ranks are alive when
the signal comes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from assistant.probing.processes import MARKER_VAR, has_proc, pids_with_marker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not has_proc(), reason="finds the launch's processes in /proc"),
]

# As from a terminal: a test runner started under nohup or in the background
# may leave SIGHUP ignored, and the child would inherit that.
CLI = (
    "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "from assistant.cli import main; sys.exit(main())"
)


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries PROBE_TEST_TAG=tag."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and environ_of(int(entry.name)).get("PROBE_TEST_TAG") == tag
    ]


def wait_for_ranks(child: subprocess.Popen, tag: str, nproc: int, seconds: float = 120.0) -> str:
    """The launch marker, once torchrun and all its ranks exist."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"assistant ended before its ranks ran: {child.stderr.read()}")
        markers = {environ_of(pid).get(MARKER_VAR) for pid in tagged(tag)} - {None}
        for marker in markers:
            if len(pids_with_marker(marker)) >= nproc + 1:  # torchrun + its ranks
                return marker
        time.sleep(0.1)
    raise AssertionError("the probe launch never started its ranks")


# Files other libraries keep in TMPDIR for the whole machine, not a launch's
# leftovers: ONNX Runtime's telemetry session file (written on import, by the
# query path), torch's compile cache.
SHARED_CACHES = {".ses", "torchinductor_root"}


def left_in(temp: Path) -> list[Path]:
    """What a command left in its TMPDIR, other than libraries' shared caches."""
    return [path for path in temp.iterdir() if path.name not in SHARED_CACHES]


@pytest.mark.parametrize(
    "sig, command",
    [
        (signal.SIGTERM, ["probe", "versions", "system"]),
        (signal.SIGHUP, ["probe", "versions"]),
        (signal.SIGTERM, ["doctor", "--json"]),
        # ask runs the probes in a worker thread while it retrieves
        (signal.SIGHUP, ["ask", "--json", "NCCL error: unhandled system error"]),
    ],
    ids=["SIGTERM-probe", "SIGHUP-probe", "SIGTERM-doctor", "SIGHUP-ask"],
)
def test_a_signal_kills_every_process_of_the_launch_and_removes_its_folders(
    hanging_probes, tmp_path, sig, command
):
    tag = uuid.uuid4().hex
    temp = tmp_path / "tmp"
    temp.mkdir()
    # ask may build its index: into a folder of the test's own
    env = {
        **os.environ,
        "PROBE_TEST_TAG": tag,
        "TMPDIR": str(temp),
        "ASSISTANT_BUILD": str(tmp_path / "build"),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", CLI, *command, "--nproc-per-node", "2"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        marker = wait_for_ranks(child, tag, nproc=2)
        assert list(temp.glob("ddp-probes-*")), "the launch's folder should exist meanwhile"
        started = time.monotonic()
        child.send_signal(sig)
        _, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    took = time.monotonic() - started
    assert child.returncode == 128 + sig, (child.returncode, took, stderr[-3000:])
    assert f"assistant: terminated by {signal.Signals(sig).name}" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    assert took < 30
    assert pids_with_marker(marker) == []
    assert tagged(tag) == []
    assert left_in(temp) == []  # ours and torchrun's (torchelastic_*) alike


# The chat's case: the runner works in a worker thread, the signal lands in
# the main thread. The worker is not a daemon: the exit waits for it, so it
# must notice the stop by itself.
IN_A_WORKER = """
import sys, threading, time
from assistant.probing import processes
from assistant.probing.runner import ProbeRunner

def work():
    runs = ProbeRunner(nproc_per_node=2, timeout=120).run(["versions"])
    print("worker", runs[0].status, flush=True)

try:
    with processes.signals_raise():
        threading.Thread(target=work).start()
        while True:
            time.sleep(0.1)
except processes.Terminated as exc:
    sys.exit(exc.exit_code)
"""


def test_a_signal_stops_a_runner_working_in_another_thread(hanging_probes, tmp_path):
    tag = uuid.uuid4().hex
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "PROBE_TEST_TAG": tag, "TMPDIR": str(temp)}
    child = subprocess.Popen(
        [sys.executable, "-c", IN_A_WORKER],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        marker = wait_for_ranks(child, tag, nproc=2)
        child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 128 + signal.SIGTERM, stderr
    assert "worker interrupted" in stdout  # the worker stopped as on a cancel
    assert pids_with_marker(marker) == []
    assert tagged(tag) == []
    assert left_in(temp) == []  # ours and torchrun's (torchelastic_*) alike


class DroppedTermination:
    """Raises Terminated where Python cannot raise it: in __del__."""

    def __del__(self):
        from assistant.probing.processes import Terminated

        raise Terminated(signal.SIGHUP)


class DroppedError:
    def __del__(self):
        raise ValueError("not ours")


def test_a_termination_python_could_not_raise_prints_no_traceback():
    """A signal landing in a weakref callback or a __del__ (an import's module
    lock, seen in CI) is dropped by Python with "Exception ignored" and a
    traceback; the watchdog ends the run anyway, so only other errors reach the
    unraisable hook."""
    from assistant.probing.processes import signals_raise

    seen: list[type] = []
    before = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(type(unraisable.exc_value))
    try:
        with signals_raise():
            DroppedTermination()  # collected at once: __del__ raises
            DroppedError()
        DroppedTermination()  # outside, the hook is the one before
    finally:
        sys.unraisablehook = before
    assert [kind.__name__ for kind in seen] == ["ValueError", "Terminated"]


SWALLOWED_BY_C = """
import os, signal, sys
from assistant.probing import processes
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as from a terminal, as CLI does

def extension_import():
    # what torch's C import did in CI with the Terminated a signal raised in it
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        signal.pause()
    except processes.Terminated:
        raise TypeError("expected a message argument")

try:
    with processes.signals_raise():
        extension_import()
except processes.Terminated as exc:
    print(type(exc.__cause__).__name__)
    sys.exit(exc.exit_code)
"""


def test_a_signal_that_c_code_turned_into_another_error_still_ends_the_command_as_the_signal():
    done = subprocess.run(
        [sys.executable, "-c", SWALLOWED_BY_C],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert done.stdout.strip() == "TypeError"
    assert "Traceback" not in done.stderr


# A signal landing while a module is imported: torch's C++ initialisation turned
# the exception raised in it into an abort (exit -6, seen in CI with `ask`).
DURING_AN_IMPORT = """
import os, signal, sys, time
from pathlib import Path
from assistant.probing import processes
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as from a terminal, as CLI does
folder = Path(sys.argv[1])
(folder / "slow_module.py").write_text(
    "import os, signal, time\\n"
    "os.kill(os.getpid(), signal.SIGHUP)\\n"
    "open(os.environ['REACHED'], 'w').close()  # the import went on: nothing raised in it\\n"
    "time.sleep(30)\\n"
)
sys.path.insert(0, str(folder))
try:
    with processes.signals_raise():
        import slow_module
except processes.Terminated as exc:
    sys.exit(exc.exit_code)
"""


def test_a_signal_during_an_import_raises_nothing_there_and_ends_the_run_at_once(tmp_path):
    """The watchdog ends the run (its message says so), not a Terminated raised
    through the import."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DURING_AN_IMPORT, str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert "assistant: terminated by SIGHUP" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 20  # not the import's 30 s, nor the 5 s escape wait
