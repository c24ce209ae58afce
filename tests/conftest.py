"""Shared fixtures: a real index over the real KB, built once per session."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from assistant.probing.processes import MarkedProcess, start_marked

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A lint check that raises is skipped for users (and named); here it must fail the test.
os.environ["ASSISTANT_LINT_RAISE"] = "1"
# The tests never write into the user's own cache (`assistant run` logs and their
# pruning, re-exported graphs): every session gets a cache of its own, removed at exit.
# Under xdist every worker makes its own, beside the controller's (not inside its
# TMPDIR: a Unix socket path nested that deep is too long for Chromium).
SYSTEM_TMP = os.environ.setdefault("DDP_ASSISTANT_SYSTEM_TMP", tempfile.gettempdir())
TEST_CACHE = tempfile.mkdtemp(prefix="ddp-assistant-test-cache-", dir=SYSTEM_TMP)
os.environ["XDG_CACHE_HOME"] = TEST_CACHE
atexit.register(shutil.rmtree, TEST_CACHE, ignore_errors=True)
# Nor into the machine's /tmp: torchrun makes a torchelastic_* log folder (and
# error-file pickles) in the TMPDIR of whatever launches it, and the tests launch
# it often. tempfile's own default is already fixed above, so pytest's folders
# stay where they were; only the launched processes see this one.
TEST_TMP = tempfile.mkdtemp(prefix="ddp-assistant-test-tmp-", dir=SYSTEM_TMP)
os.environ["TMPDIR"] = TEST_TMP
atexit.register(shutil.rmtree, TEST_TMP, ignore_errors=True)


@pytest.fixture
def terminal_sigint():
    """Children started during the test get SIGINT as a person's Ctrl-C reaches them.

    A shell script runs background jobs (`.ci/run ... &`) with SIGINT ignored;
    pytest inherits that, and so would every child: Python then installs no
    KeyboardInterrupt handler, and a child rightly ignores SIGINT, as any
    program started under nohup does. A Python handler here, unlike SIG_IGN,
    is reset to the default by exec.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    """A private build directory, so tests never touch data/build/."""
    path = tmp_path_factory.mktemp("build")
    os.environ["ASSISTANT_BUILD"] = str(path)
    return path


@pytest.fixture(scope="session")
def embedder(build_dir):
    """The real embedding model, loaded once for the whole session.

    Its exported ONNX graph (onnxembed) goes to the private build directory.
    """
    from assistant.knowledge.embed import Embedder

    model = Embedder()
    model.load()
    return model


@pytest.fixture(scope="session")
def engine(build_dir, embedder):
    """The real engine: real KB, real SQLite + FAISS index, real embedding model."""
    from assistant.knowledge.engine import Engine

    eng = Engine(index_path=build_dir / "index.sqlite", log=lambda message: None, embedder=embedder)
    eng.load()
    return eng


@pytest.fixture
def mini_kb(tmp_path) -> Path:
    """A small valid KB (one cause, one thread) that tests may break."""
    root = tmp_path / "kb"
    (root / "causes").mkdir(parents=True)
    (root / "threads").mkdir()
    shutil.copy(REPO / "kb/causes/duplicate-gpu-per-rank.yaml", root / "causes")
    shutil.copy(DATA / "kb_mini_thread.yaml", root / "threads/mini.yaml")
    return root


TORCHRUN_TIMEOUT_S = 180


class TorchrunHung(AssertionError):
    """A launch still running past its timeout, killed: what it printed, and
    what was still alive (state and kernel wait channel of each process)."""

    def __init__(self, command: list[str], waited_s: float, stdout: str, stderr: str, left: str):
        super().__init__(
            f"{Path(command[-1]).name} still ran after {waited_s} s; alive then:\n"
            f"{left}\nstdout tail: {stdout[-1000:]}\nstderr tail: {stderr[-2000:]}"
        )
        self.stdout, self.stderr, self.left = stdout, stderr, left


class TorchrunRankCrashed(UserWarning):
    """A torchrun launch whose rank crashed (SIGABRT / SIGSEGV / SIGBUS), launched again."""


def text(output: bytes) -> str:
    return output.decode(errors="replace")


def describe_processes(pids: list[int]) -> str:
    """One line per live process: pid, state, wait channel, command line."""
    lines = []
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
            threads = len(os.listdir(f"/proc/{pid}/task"))
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # gone meanwhile
        lines.append(f"  {pid} {state} {wchan} threads={threads} {cmdline.decode()[:160]}")
    return "\n".join(lines) or "  (nothing)"


class Torchrun:
    """`torchrun --standalone --nproc_per_node=2 SCRIPT ARGS...` (CPU ranks here;
    `nproc=` for another count).

    --standalone lets the rendezvous pick its own free port: a port chosen here
    and released before torchrun binds it can be taken by a parallel test. A
    call runs in the test's own folder, so what a script saves stays out of the
    checkout; `start` launches at once in a folder of its own, so that two
    launches (a broken fixture and its twin) overlap: each spends most of its
    time importing torch, and two cores import two at once.
    """

    # for the tests' helpers, which cannot import a conftest
    Hung = TorchrunHung
    RankCrashed = TorchrunRankCrashed

    @staticmethod
    def crashed(result: subprocess.CompletedProcess) -> bool:
        """Whether the run's first failing rank died of a crash signal, not an error it threw."""
        return result.returncode != 0 and killed_by_a_crash_signal(result.stderr)

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.launched: list[MarkedProcess] = []
        self.timeout_s = TORCHRUN_TIMEOUT_S

    def close(self) -> None:
        """Kill what is still running (a launch whose test failed before waiting):
        torchrun and its workers, which torchrun puts in sessions of their own."""
        for launch in self.launched:
            launch.stop(grace=0.5)  # cheap after a normal exit; it also unregisters
            if not launch.process.stdout.closed:  # never waited for
                launch.process.communicate(timeout=30)

    def __call__(self, script: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
        return self.start(script, *args, cwd=self.folder, nproc=nproc)()

    def start(
        self, script: Path, *args: str, cwd: Path | None = None, nproc: int = 2
    ) -> Callable[[], subprocess.CompletedProcess]:
        """Launch now; the call returned waits for the run (killed past the timeout).

        A run whose first failing rank was killed by SIGABRT, SIGSEGV or SIGBUS, not on an
        error it threw, is launched once more, with a warning that keeps what the
        first run printed: on a loaded machine a gloo rank sometimes aborts in the
        interpreter's teardown after its work is done (tests/data/scripts/README.md),
        which is not what the fixture is about. A fixture that really dies that
        way dies twice.
        """
        if cwd is None:
            cwd = self.folder / f"run-{script.stem}"
            cwd.mkdir(exist_ok=True)
        wait_first = self.launch(script, args, cwd, nproc)

        def wait() -> subprocess.CompletedProcess:
            result = wait_first()
            if result.returncode == 0 or not killed_by_a_crash_signal(result.stderr):
                return result
            warnings.warn(
                f"{script.name}: a rank crashed (rerun once); its output:\n"
                f"{result.stdout[-1500:]}\n{result.stderr[:4000]}",
                TorchrunRankCrashed,
                stacklevel=2,
            )
            return self.launch(script, args, cwd, nproc)()

        return wait

    def launch(
        self, script: Path, args: tuple[str, ...], cwd: Path, nproc: int
    ) -> Callable[[], subprocess.CompletedProcess]:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--log_dir={self.folder / f'torchelastic-{script.stem}-{len(self.launched)}'}",
            str(script),
            *args,
        ]
        # Marked, as the assistant launches torchrun: the workers live in sessions
        # of their own and hold the output pipes, so a kill must find them too.
        # faulthandler: a rank that crashes prints every thread's Python stack.
        launch = start_marked(
            command,
            cwd=cwd,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.launched.append(launch)
        process = launch.process

        def wait() -> subprocess.CompletedProcess:
            try:
                out, err = process.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                left = describe_processes(launch.pids())
                launch.stop(grace=0.5)
                out, err = process.communicate(timeout=30)
                raise TorchrunHung(command, self.timeout_s, text(out), text(err), left) from None
            return subprocess.CompletedProcess(command, process.returncode, text(out), text(err))

        return wait


# torchrun's failure summary: "exitcode  : -6 (pid: 29159)  (SIGABRT)" for the
# root cause, the first rank that failed.
ROOT_CAUSE_EXIT = re.compile(
    r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.DOTALL
)


# A rank that aborted on an error it threw (gloo's size check on a collective
# mismatch): what a broken fixture is about, so it is not launched again.
THROWN = "terminate called after throwing"


# The signals a rank that crashed (not one that threw) dies of: SIGBUS too, which
# CI once saw a gloo rank die of on a loaded machine (exit code -7), the fixture's
# file linted alone and rerun passing.
CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


def killed_by_a_crash_signal(stderr: str) -> bool:
    found = ROOT_CAUSE_EXIT.search(stderr)
    crashed = found is not None and -int(found.group(1)) in CRASH_SIGNALS
    return crashed and THROWN not in stderr


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Torchrun]:
    """Runs a script under torchrun on two CPU ranks (see Torchrun)."""
    runner = Torchrun(tmp_path)
    yield runner
    runner.close()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist (`-n 2 --dist loadgroup`, as README runs the tests), what is costly
    and shared is made once: the tests that read the held-out figures of every
    real-report set (minutes of ridge fits) run on one worker, and so do the tests
    of a file that share a module-scoped fixture (a lint of every blind script, a
    browser). The multi-node tests run on one worker too: their torchrun agents all
    work in the repository with one rendezvous id, so two such runs at once would
    read each other's storage markers. The rest spread over the workers one by one."""
    for item in items:
        group = shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def shared_fixture_group(item: pytest.Item) -> str | None:
    if "real_report_evaluations" in getattr(item, "fixturenames", ()):
        return "real_report_evaluations"
    if item.nodeid.startswith("tests/multinode/"):
        return "multinode"
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info else ()
    if any(d[-1].scope in ("module", "class") for d in definitions if d):
        return item.nodeid.split("::")[0]
    return None
