"""Child processes that leave nothing behind: start, find, kill, clean up on any signal.

torchrun puts each worker in a session of its own, so neither a
process-group kill nor the kernel's "parent died" reaches them. What does
reach them is an environment variable: every process started here carries
MARKER_VAR=<marker>, torchrun passes it on to its workers, and /proc lists
every live process whose environment holds it.

Public API (also used by `assistant run`, which wraps the user's launch):

    marked = start_marked(["torchrun", ...], env=..., cwd=..., stdout=log)
    marked.pids()                      # every live process of the launch
    marked.stop()                      # SIGTERM, grace, SIGKILL: the whole tree;
                                       # call it after a normal exit too (it
                                       # unregisters the launch; cheap then)
    pids_with_marker(marker)           # the same without the Popen object
    kill_marked(marker, grace=2.0)     # ... and the same kill

    with tracked_folder("ddp-probes-") as path:   # removed on exit or on a signal
        ...

    with signals_raise():              # the CLI wraps every command in this
        ...                            # SIGTERM/SIGHUP raise Terminated here

Hostile signals: SIGINT already raises KeyboardInterrupt in the main thread.
signals_raise() makes SIGTERM and SIGHUP raise Terminated (a BaseException,
like KeyboardInterrupt) the same way, so `finally` blocks run. Neither
arrives in a worker thread (the chat runs probes in one), so cleanup never
relies on the thread that owns a launch: each live launch and tracked
folder is in a process-wide register, and when signals_raise() exits on an
interrupt it kills every registered launch and removes every registered
folder itself. It also sets stop_requested(), which a worker polls to stop
early; start_marked() refuses to start anything once it is set. Should the
exception be swallowed on its way up (an `except BaseException`, a C
callback), a watchdog does the same cleanup after ESCAPE_SECONDS and exits.

Exit codes (assistant.errors.ExitCode): 130 for SIGINT, 128 + signum for
SIGTERM (143) and SIGHUP (129), as a shell reports a process killed by them.

Standard library only: GPU nodes that run the probes may lack the
assistant's heavier dependencies. Without /proc (macOS) only the started
process and its process group can be signalled.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MARKER_VAR = "ASSISTANT_LAUNCH_ID"
KILL_GRACE_SECONDS = 2.0
# After SIGTERM/SIGHUP, how long the Terminated exception has to reach
# signals_raise() before a watchdog cleans up and exits by itself: code that
# swallows every exception (or a C callback that turns it into another
# error) must not keep a terminated command alive.
ESCAPE_SECONDS = 5.0
POLL_SECONDS = 0.05
# Signals that mean "the person or the system wants this command gone".
HOSTILE_SIGNALS = tuple(
    sig for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if sig
)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived; raised in the main thread like KeyboardInterrupt.

    A BaseException so that `except Exception` in a front end does not
    swallow it. exit_code is 128 + signum, the code a shell would show.
    """

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# --- finding and killing -------------------------------------------------------


def has_proc() -> bool:
    """Whether /proc lists processes' environments (Linux)."""
    return Path("/proc/self/environ").exists()


def pids_with_marker(marker: str) -> list[int]:
    """Live processes whose environment carries MARKER_VAR=marker."""
    return pids_with_env(MARKER_VAR, marker)


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment carries name=value.

    Zombies have an empty environment in /proc, so they are not listed;
    neither are other users' processes (their environ is unreadable).
    """
    if not has_proc():
        return []
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                if wanted in environ.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours
    return found


def kill_marked(
    marker: str,
    grace: float = KILL_GRACE_SECONDS,
    process: subprocess.Popen | None = None,
) -> None:
    """Kill every process carrying the marker: SIGTERM, then SIGKILL after grace.

    process, when given, is the started process itself (torchrun): it is
    signalled with its process group too, and reaped. Once its workers are
    gone torchrun has nothing left to clean up, so it gets SIGKILL at once
    rather than the second or two its own shutdown takes. Without /proc the
    workers cannot be seen: torchrun then gets a longer grace to stop them.
    """
    visible = has_proc()
    first_grace = grace if visible or process is None else max(grace, 10.0)
    for sig, wait in ((signal.SIGTERM, first_grace), (signal.SIGKILL, 5.0)):
        if _signal_all(marker, process, sig, wait, visible):
            break
    if process is not None:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # unkillable (D state); nothing more a user process can do


def _signal_all(marker, process, sig, wait, visible) -> bool:
    """Send sig to the launch; True once nothing of it is left within wait seconds."""
    targets = set(pids_with_marker(marker))
    if process is not None and process.poll() is None:
        targets.add(process.pid)
        send_group(process.pid, sig)
    for pid in targets:
        send(pid, sig)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        # torchrun first: once it is dead it cannot start another worker,
        # so an empty scan after that is final.
        dead = process is None or process.poll() is not None
        left = set(pids_with_marker(marker)) - ({process.pid} if process else set())
        if not left:
            if dead:
                return True
            if visible:
                send(process.pid, signal.SIGKILL)
        time.sleep(POLL_SECONDS)
    return False


def send(pid: int, sig: int) -> None:
    """os.kill that ignores processes already gone or not ours."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def send_group(pgid: int, sig: int) -> None:
    """os.killpg that ignores groups already gone or not ours."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- starting ----------------------------------------------------------------


@dataclass
class MarkedProcess:
    """A started command and the marker every process of its tree carries."""

    process: subprocess.Popen
    marker: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def pids(self) -> list[int]:
        """Every live process of the tree (the started one included)."""
        return pids_with_marker(self.marker)

    def stop(self, grace: float = KILL_GRACE_SECONDS) -> None:
        """Kill the whole tree (SIGTERM, grace, SIGKILL) and forget it.

        Forgotten only once the kill is through: a signal that cuts it
        short leaves it registered, for stop_everything() to finish.
        """
        kill_marked(self.marker, grace, self.process)
        _REGISTER.forget_process(self)


def new_marker() -> str:
    return uuid.uuid4().hex


def start_marked(
    command: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin=subprocess.DEVNULL,
    stdout=None,
    stderr=None,
    marker: str | None = None,
) -> MarkedProcess:
    """Start command (no shell) in its own session, marked, and registered.

    env replaces os.environ (None: inherit it); MARKER_VAR is added. The
    session of its own keeps a Ctrl-C in the terminal from reaching the
    ranks before we decide what to do. Registered: a signal caught by
    signals_raise() kills it even when it was started from another thread.
    Raises OSError if the command cannot start, Terminated once a stop was
    requested (nothing new may start while the command is being torn down).
    """
    marker = marker or new_marker()
    full_env = dict(os.environ if env is None else env)
    full_env[MARKER_VAR] = marker
    with _REGISTER.lock:  # no start can slip between a stop request and its sweep
        if _REGISTER.stopping.is_set():
            raise Terminated(_REGISTER.signum or signal.SIGTERM)
        # The marker is registered before the start: a signal between the
        # start and the line below still leaves the tree findable by it.
        _REGISTER.processes[marker] = None
        try:
            process = subprocess.Popen(
                list(command),
                env=full_env,
                cwd=cwd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        except OSError:
            del _REGISTER.processes[marker]
            raise
        marked = MarkedProcess(process, marker)
        _REGISTER.processes[marker] = marked
    return marked


@contextmanager
def tracked_folder(prefix: str) -> Iterator[Path]:
    """A fresh temporary folder, removed on exit and also by a signal's cleanup."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    with _REGISTER.lock:
        _REGISTER.folders.add(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        with _REGISTER.lock:
            _REGISTER.folders.discard(path)


# --- the register of live launches and the signal handling ------------------


class _Register:
    """Process-wide: live marked processes, tracked folders, the stop request."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # marker -> its started process (None while it is being started)
        self.processes: dict[str, MarkedProcess | None] = {}
        self.folders: set[Path] = set()
        self.stopping = threading.Event()
        self.signum: int | None = None
        self.handled = threading.Event()  # the interrupt reached signals_raise()

    def forget_process(self, marked: MarkedProcess) -> None:
        with self.lock:
            self.processes.pop(marked.marker, None)


_REGISTER = _Register()


def stop_requested() -> bool:
    """True once a signal asked this command to stop (workers poll it)."""
    return _REGISTER.stopping.is_set()


def registered_markers() -> list[str]:
    """Markers of the launches started here (or starting) and not stopped yet."""
    with _REGISTER.lock:
        return list(_REGISTER.processes)


def live_markers() -> list[str]:
    """Markers of the launches started here and not stopped yet."""
    with _REGISTER.lock:
        return [
            marker
            for marker, marked in _REGISTER.processes.items()
            if (marked is not None and marked.poll() is None) or pids_with_marker(marker)
        ]


def stop_everything(grace: float = KILL_GRACE_SECONDS) -> None:
    """Kill every registered launch and remove every tracked folder, from any thread.

    Sets stop_requested() first, so that threads running launches stop
    instead of starting new ones.
    """
    with _REGISTER.lock:
        _REGISTER.stopping.set()
        launches = list(_REGISTER.processes.items())
    for marker, marked in launches:
        if marked is None:
            kill_marked(marker, grace)
            _REGISTER.processes.pop(marker, None)
        else:
            marked.stop(grace)
    with _REGISTER.lock:
        folders = list(_REGISTER.folders)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP raise Terminated in the main thread; any interrupt cleans up.

    On leaving through KeyboardInterrupt or Terminated, every registered
    launch is killed and every tracked folder removed before the exception
    goes on, whichever thread started them. A second signal while that
    cleanup runs is ignored rather than cutting the cleanup short. A signal
    already ignored (nohup) stays ignored. Outside the main thread (where
    handlers cannot be set) it only does the cleanup.
    """
    previous = {}
    unraisable = sys.unraisablehook
    if threading.current_thread() is threading.main_thread():
        for sig in HOSTILE_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # `nohup assistant doctor`: the person asked to survive it
            previous[sig] = signal.signal(sig, _raise_terminated)
        sys.unraisablehook = _quiet_terminated(unraisable)
    try:
        yield
    except (KeyboardInterrupt, Terminated):
        _stop_for_interrupt(previous)
        raise
    except BaseException as exc:
        if _REGISTER.signum is None:
            raise
        # The signal's Terminated was raised inside C code that replaced it
        # with an error of its own (torch's extension import turned it into
        # "TypeError: expected a message argument", seen in CI): the command
        # still ends as the signal asked, with no traceback.
        _stop_for_interrupt(previous)
        raise Terminated(_REGISTER.signum) from exc
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = unraisable


def _stop_for_interrupt(handled_signals) -> None:
    """Tell the watchdog the interrupt arrived, then kill and remove everything."""
    _REGISTER.handled.set()
    for sig in handled_signals:
        signal.signal(sig, signal.SIG_IGN)  # the cleanup runs to its end
    stop_everything()


def _quiet_terminated(hook):
    """`hook`, except for a Terminated that Python could not raise.

    A signal that lands while Python runs a weakref callback or a __del__ (an
    import's module lock, seen in CI) has its exception printed as "Exception
    ignored in ..." with a traceback, then dropped; _exit_unless_handled still
    ends the run, so the traceback would only be noise on the person's terminal.
    """

    def quiet(unraisable) -> None:
        if not isinstance(unraisable.exc_value, Terminated):
            hook(unraisable)

    return quiet


def _raise_terminated(signum: int, frame) -> None:
    if _REGISTER.signum is not None:
        return  # already stopping
    _REGISTER.signum = signum
    _REGISTER.stopping.set()  # worker threads see it at their next poll
    # Inside an import, an exception can reach a C extension's initialisation, which
    # may abort the process instead of passing it on (torch's did: exit -6, seen in
    # CI): there the watchdog cleans up and ends the run at once, and nothing is raised.
    importing = inside_an_import(frame)
    watchdog = threading.Thread(
        target=_exit_unless_handled,
        args=(signum, 0.0 if importing else ESCAPE_SECONDS),
        name="assistant-stop",
        daemon=True,
    )
    watchdog.start()
    if not importing:
        raise Terminated(signum)


def inside_an_import(frame) -> bool:
    """Whether the interrupted code runs under an import statement."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib."):
            return True
        frame = frame.f_back
    return False


def _exit_unless_handled(signum: int, wait: float = ESCAPE_SECONDS) -> None:
    """If Terminated was swallowed on its way up (or never raised), clean up and exit."""
    if _REGISTER.handled.wait(wait):
        return
    stop_everything()
    try:
        os.write(2, f"assistant: {Terminated(signum)}\n".encode())
    except OSError:
        pass  # SIGHUP: the terminal may be gone
    os._exit(128 + signum)
