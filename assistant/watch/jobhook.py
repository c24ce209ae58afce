"""The hook `assistant run` puts into every Python process of the user's job.

This file is copied as `sitecustomize.py` into a folder put first on the
job's PYTHONPATH, so every Python process the launch starts (torchrun's
agent, its workers, mp.spawn children, srun tasks on this node) imports it
at start-up. It does nothing unless WATCH_DIR_VAR names a writable folder,
and then, per process, in WATCH_DIR/procs/:

- <pid>.json      who the process is: pid, parent, host, rank variables, its
                  main thread, later the rank torch.distributed gave it;
- <pid>.out/.err  its stdout and stderr (fd 1 and 2 are redirected here when
                  they were the launch's own output; the watcher streams them
                  to the terminal unchanged as they grow, and they survive a
                  SIGKILL of the process);
- <pid>.error.json the exception that ended it, as data (type, message,
                  traceback frames), from sys.excepthook, threading.excepthook
                  and mp.spawn's own wrapper (which never reaches excepthook);
                  a launcher's failure also carries its per-rank exit codes;
- <pid>.stacks    every thread's stack, written by faulthandler when the
                  watcher sends STACK_SIGNAL: the stack of a hung rank without
                  killing it, even while C code holds the GIL;
- <pid>.progress  a counter that grows each time the main thread is seen
                  leaving a torch.distributed collective (or a backward pass,
                  where DDP's all_reduce runs): "a rank left a collective";
- <pid>.fr.json   torch's flight recorder (the collectives this rank issued,
                  NCCL or gloo), dumped when the watcher writes <pid>.fr-request;
- <pid>.exit      written at a normal interpreter exit.

It then imports the user's own sitecustomize, if any, so it stays invisible.
Standard library only: it runs in the user's training environment, with
whatever Python that is, before anything else.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import signal
import sys
import threading
import time

WATCH_DIR_VAR = "ASSISTANT_WATCH_DIR"
HOOK_DIR_VAR = "ASSISTANT_WATCH_HOOK"
# A real-time signal: no launcher, library or Slurm uses it, unlike SIGUSR1/2.
STACK_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
SAMPLE_SECONDS = 0.2
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID")
# Functions of torch.distributed a rank can block in (the main thread's
# frames are compared against these names inside torch/distributed/).
# A superset of assistant.lint.torchapi.COLLECTIVES, copied because this
# file cannot import the package (tests/watch/test_watch_parts.py checks it).
COLLECTIVES = frozenset(
    [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "wait",
        "init_process_group",
        "new_group",
        "destroy_process_group",
    ]
)


class _State:
    """This process's files; None everywhere when the hook is off."""

    procs: str | None = None
    pid: int = 0
    record: dict = {}  # noqa: RUF012 - one instance; replaced whole by install()
    stack_file = None
    progress_fd: int | None = None
    progress: int = 0


STATE = _State()


def procs_dir(watch_dir: str) -> str:
    """The folder of per-process files under a watch folder."""
    return os.path.join(watch_dir, "procs")


# --- writing files --------------------------------------------------------------


def _path(suffix: str) -> str:
    return os.path.join(STATE.procs, f"{STATE.pid}{suffix}")


def _write_json(suffix: str, payload: dict) -> None:
    """Atomically, so the watcher never reads half a record."""
    final = _path(suffix)
    partial = f"{final}.part"
    with open(partial, "w", encoding="utf-8") as out:
        json.dump(payload, out)
    os.replace(partial, final)


def _update_record(**values) -> None:
    STATE.record.update(values)
    _write_json(".json", STATE.record)


# --- exceptions as data ------------------------------------------------------


def type_name(exc_type) -> str:
    """The exception type as a traceback prints it (module-qualified unless builtin)."""
    module = getattr(exc_type, "__module__", "")
    qualname = getattr(exc_type, "__qualname__", exc_type.__name__)
    return qualname if module in ("builtins", "__main__", "") else f"{module}.{qualname}"


def _frames(tb) -> list[dict]:
    import traceback  # only when something raised: every process of the job starts faster

    return [
        {"file": f.filename, "line": f.lineno, "function": f.name}
        for f in traceback.extract_tb(tb)
        if f.filename != __file__
    ]


def _launch_failures(exc) -> list[dict]:
    """Per-rank exit codes a launcher knows (torchrun's ChildFailedError, mp.spawn's errors)."""
    failures = []
    for rank, failure in (getattr(exc, "failures", None) or {}).items():  # torchrun: by global rank
        failures.append(
            {
                "rank": rank if isinstance(rank, int) else None,
                "local_rank": getattr(failure, "local_rank", None),
                "pid": getattr(failure, "pid", None),
                "exit_code": getattr(failure, "exitcode", None),
            }
        )
    if hasattr(exc, "error_index") and hasattr(exc, "error_pid"):  # mp.spawn
        failures.append(
            {
                "rank": exc.error_index,
                "local_rank": exc.error_index,
                "pid": exc.error_pid,
                "exit_code": getattr(exc, "exit_code", None),
            }
        )
    return failures


def record_exception(exc: BaseException, thread: str = "MainThread") -> None:
    """Write this process's exception record (the first one wins: it is the root)."""
    if STATE.procs is None or os.path.exists(_path(".error.json")):
        return
    import traceback

    try:
        _write_json(
            ".error.json",
            {
                "pid": STATE.pid,
                "time": time.time(),
                "type": type_name(type(exc)),
                "message": str(exc),
                "thread": thread,
                "frames": _frames(exc.__traceback__),
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                "failures": _launch_failures(exc),
            },
        )
        _note_rank()
    except Exception:  # noqa: BLE001, S110 - never change how the user's program fails
        pass


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            record_exception(exc)
        previous(exc_type, exc, tb)

    return hook


def _threading_excepthook(previous):
    def hook(args):
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            name = args.thread.name if args.thread is not None else "thread"
            record_exception(args.exc_value, thread=name)
        previous(args)

    return hook


# --- the rank --------------------------------------------------------------------


def _note_rank() -> None:
    """Record the rank torch.distributed gave this process, once it has one."""
    if "dist_rank" in STATE.record:
        return
    if not _dist_initialized():
        return
    dist = sys.modules["torch.distributed"]
    try:
        _update_record(dist_rank=dist.get_rank(), world_size=dist.get_world_size())
    except (RuntimeError, ValueError, OSError):
        return  # the group is being torn down; the next sample tries again


# --- progress: the main thread leaving a collective ----------------------------


def _collective_frame(frame):
    """The outermost torch.distributed collective (or backward) frame on a stack."""
    found = None
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in path and code.co_name in COLLECTIVES:
            found = frame
        elif "/torch/autograd/" in path and code.co_name == "backward":
            found = frame  # DDP's gradient all_reduce runs inside backward
        frame = frame.f_back
    return found


def _dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 - torch.distributed half imported
        return False


def _stack_signature(frame) -> tuple:
    spots = []
    while frame is not None:
        spots.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return tuple(spots)


def _sample(main_id: int) -> None:
    """Count the main thread's progress, by sampling its stack.

    After init_process_group, progress means leaving a collective: a rank
    that waits stays in the same frame object; a new frame object (held
    here so its id cannot be reused) or none means it moved on. Before it,
    any change of the stack counts (importing torch on a busy machine is
    slow, and silent).
    """
    held = None
    signature = None
    while True:
        time.sleep(SAMPLE_SECONDS)
        frame = sys._current_frames().get(main_id)
        if frame is None:
            return  # the main thread has ended
        current = _collective_frame(frame)
        moved = held is not None and current is not held
        if not _dist_initialized():
            now = _stack_signature(frame)
            moved = moved or (signature is not None and now != signature)
            signature = now
        del frame
        held = current
        del current
        if moved:
            STATE.progress += 1
            try:
                os.pwrite(STATE.progress_fd, str(STATE.progress).encode().ljust(20), 0)
            except OSError:
                return
        _note_rank()
        _serve_flight_recorder()


# --- the flight recorder, dumped on request ---------------------------------------

# Dump functions of torch's flight recorder, newest name first (2.x releases
# before the generic one had only the NCCL dump).
FR_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
FR_KEEP = 20  # the last entries kept per dump: enough to see the collective each rank is at
FR_KEYS = (
    "collective_seq_id",
    "p2p_seq_id",
    "profiling_name",
    "state",
    "retired",
    "process_group",
    "is_p2p",
)


def _serve_flight_recorder() -> None:
    """When the watcher asks (a <pid>.fr-request file), write the flight recorder's last entries.

    Runs in the sampling thread: a main thread blocked in a collective has
    released the GIL, so the dump is taken while the rank still waits.
    """
    request = _path(".fr-request")
    if STATE.procs is None or not os.path.exists(request):
        return
    try:
        os.unlink(request)
        _write_json(".fr.json", flight_record())
    except OSError:
        return


def flight_record() -> dict:
    """The flight recorder's last entries in this process, or why there are none."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = next((getattr(c10d, name) for name in FR_DUMPS if hasattr(c10d, name)), None)
    if dump is None:
        return {"available": False, "why": "this torch has no flight recorder"}
    try:
        entries = json.loads(dump()).get("entries") or []
    except Exception as exc:  # noqa: BLE001 - any failure of the dump is reported, not raised
        return {"available": False, "why": f"{type(exc).__name__}: {exc}"}
    kept = [{key: entry.get(key) for key in FR_KEYS} for entry in entries[-FR_KEEP:]]
    return {"available": True, "entries": kept}


# --- mp.spawn children ---------------------------------------------------------------


def _patch_spawn(module) -> None:
    """mp.spawn's _wrap catches the child's exception and exits 1: record it first.

    The exception is the context of _wrap's SystemExit, so nothing is added
    to the user's traceback. The wrapper keeps _wrap's name: the parent
    pickles it by reference for the child.
    """
    original = getattr(module, "_wrap", None)
    if original is None:
        return

    def _wrap(fn, i, *args, **kwargs):
        if STATE.procs is not None:
            _update_record(spawn_index=i)
        try:
            return original(fn, i, *args, **kwargs)
        except SystemExit as exit_:
            if isinstance(exit_.__context__, Exception):
                record_exception(exit_.__context__)
            raise

    _wrap.__module__ = original.__module__
    _wrap.__qualname__ = original.__qualname__
    module._wrap = _wrap


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a named module is imported."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path=None, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            try:
                patch(module)
            except Exception:  # noqa: BLE001, S110 - the import itself succeeded; keep it
                pass

        spec.loader.exec_module = exec_module
        return spec


# --- install -------------------------------------------------------------------------


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) is not a rank: its output still
    # goes to the rank's files, but it must not write the rank's records.
    STATE.procs = None


def _redirect_output(watch_dir: str) -> None:
    """Send fd 1 and 2 to this process's own files, when they were coming to the watcher anyway.

    Output the launcher sent elsewhere (torchrun --redirects/--log-dir, srun's
    pipes) stays where the user's launch put it.
    """
    for fd, suffix in ((1, ".out"), (2, ".err")):
        if not _watched(fd, watch_dir):
            continue
        target = os.open(_path(suffix), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _watched(fd: int, watch_dir: str) -> bool:
    """Whether fd is the launch's own output file or a parent's per-process file."""
    try:
        mine = os.fstat(fd)
    except OSError:
        return False
    for name in ("launch.out", "launch.err"):
        try:
            launch = os.stat(os.path.join(watch_dir, name))
        except OSError:
            continue
        if (launch.st_dev, launch.st_ino) == (mine.st_dev, mine.st_ino):
            return True
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return os.path.dirname(target) == os.path.realpath(STATE.procs)


def install(watch_dir: str) -> None:
    """Turn the hook on in this process (writes its record, redirects its output)."""
    procs = procs_dir(watch_dir)
    if not os.path.isdir(procs) or not os.access(procs, os.W_OK):
        return  # e.g. an srun task on another node: leave it alone
    STATE.procs, STATE.pid = procs, os.getpid()
    main_id = threading.main_thread().ident
    STATE.record = {
        "pid": STATE.pid,
        "ppid": os.getppid(),
        "host": os.uname().nodename,  # socket.gethostname(), without importing socket
        "argv": list(getattr(sys, "orig_argv", sys.argv)),
        "executable": sys.executable,
        "env": {name: os.environ[name] for name in RANK_VARS if name in os.environ},
        "main_thread": main_id,
        "started": time.time(),
        "stack_signal": None,
    }
    _redirect_output(watch_dir)
    if STACK_SIGNAL is not None:
        STATE.stack_file = open(_path(".stacks"), "ab")  # noqa: SIM115 - open for faulthandler until exit
        faulthandler.register(STACK_SIGNAL, file=STATE.stack_file, all_threads=True)
        STATE.record["stack_signal"] = int(STACK_SIGNAL)
    STATE.progress_fd = os.open(_path(".progress"), os.O_WRONLY | os.O_CREAT, 0o644)
    _write_json(".json", STATE.record)
    sys.excepthook = _excepthook(sys.excepthook)
    threading.excepthook = _threading_excepthook(threading.excepthook)
    sys.meta_path.insert(0, _AfterImport({"torch.multiprocessing.spawn": _patch_spawn}))
    os.register_at_fork(after_in_child=_after_fork_in_child)
    atexit.register(_at_exit)
    threading.Thread(target=_sample, args=(main_id,), name="assistant-watch", daemon=True).start()


def _at_exit() -> None:
    if STATE.procs is not None:
        _note_rank()
        with open(_path(".exit"), "w") as marker:
            marker.write(str(time.time()))


def chain_user_sitecustomize(hook_dir: str) -> None:
    """Import the sitecustomize this one shadows, as Python would have."""
    here = os.path.realpath(hook_dir)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get(WATCH_DIR_VAR):
        try:
            install(os.environ[WATCH_DIR_VAR])
        except Exception as exc:  # noqa: BLE001 - the job must run even if watching cannot
            STATE.procs = None
            sys.__stderr__.write(f"assistant run: cannot watch process {os.getpid()}: {exc}\n")
    chain_user_sitecustomize(os.environ.get(HOOK_DIR_VAR) or os.path.dirname(__file__))
