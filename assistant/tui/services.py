"""The real engine, runner and helpers, imported on first use; the threads the chat keeps.

`assistant chat` must show its window in under a second, so nothing here
imports torch, sentence-transformers or the retrieval stack until a worker
thread first needs it. Tests hand fakes to the same factory
(assistant.tui.deps.chat_deps) instead.
"""

from __future__ import annotations

import asyncio
import importlib
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any


def _real(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


class LazyEngine:
    """assistant.knowledge.engine.Engine, constructed on first use (from a worker thread)."""

    def __init__(self, model: str | None = None, log: Callable[[str], None] | None = None):
        self.model = model
        self.log = log
        self._engine = None
        self._lock = threading.Lock()

    @property
    def engine(self):
        with self._lock:
            if self._engine is None:
                engine_class = _real("assistant.knowledge.engine", "Engine")
                self._engine = engine_class(model=self.model, log=self.log)
            return self._engine

    @property
    def ready(self) -> bool:
        return self._engine is not None and self._engine.ready

    def load(self) -> None:
        self.engine.load()

    def ask(self, query: str, top: int = 5, context: str | None = None):
        return self.engine.ask(query, top=top, context=context)

    def rebuild(self) -> str:
        return self.engine.rebuild()

    def cause(self, cause_id: str) -> dict:
        return self.engine.cause(cause_id)

    def signatures(self) -> dict[str, list[str]]:
        return self.engine.signatures()


class LazyRunner:
    """assistant.probing.runner.ProbeRunner, constructed on first use; other attributes pass through."""

    def __init__(self, **options: Any):
        self.options = options
        self._runner = None
        self._lock = threading.Lock()

    @property
    def runner(self):
        with self._lock:
            if self._runner is None:
                self._runner = _real("assistant.probing.runner", "ProbeRunner")(**self.options)
            return self._runner

    def run(self, names, on_progress=None, cancel=None):
        return self.runner.run(names, on_progress=on_progress, cancel=cancel)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks (e.g. `timeout`),
        # which the doctor may read from a real runner.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.runner, name)


def lint_script(path):
    """assistant.lint.script.lint_script, imported on first use."""
    return _real("assistant.lint.script", "lint_script")(path)


class EngineThread:
    """One daemon thread that makes every engine call, one at a time.

    A model load or an index build cannot be interrupted. Run in Textual's
    thread workers (the event loop's default executor), they would hold the
    process open after the person quits, since asyncio joins those threads
    at exit: up to a minute during an index build. A daemon thread is simply
    abandoned instead; a half-built index is detected and rebuilt next time.
    One thread also serializes the calls, which the engine expects.
    """

    def __init__(self, name: str = "assistant-engine"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue `function(*args, **kwargs)`; the future holds its result or exception."""
        future: Future = Future()
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put((future, function, args, kwargs))
        return future

    async def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Await `function(*args, **kwargs)` run on the engine thread."""
        return await asyncio.wrap_future(self.submit(function, *args, **kwargs))

    @property
    def busy(self) -> bool:
        """An engine call is running right now."""
        return self._busy.is_set()

    def _serve(self) -> None:
        while True:
            future, function, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it started
            self._busy.set()
            try:
                future.set_result(function(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            finally:
                self._busy.clear()


class Knowledge:
    """The knowledge side as the chat uses it: every engine call on one EngineThread.

    The pipeline's worker calls `ask` and `signatures` (they block that
    worker, never the UI); the app awaits `load`, `rebuild` and `entry`.
    A query therefore never runs while the index is being rebuilt.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.thread = EngineThread()

    @property
    def ready(self) -> bool:
        return bool(getattr(self.engine, "ready", False))

    @property
    def busy(self) -> bool:
        """An engine call (model load, index build, query) is running."""
        return self.thread.busy

    def ask(self, query: str, top: int = 5, context: str | None = None):
        return self.thread.submit(self.engine.ask, query, top=top, context=context).result()

    def signatures(self) -> dict[str, list[str]]:
        return self.thread.submit(self.engine.signatures).result()

    def cause(self, cause_id: str) -> dict:
        """A cause's KB entry, for a worker (the pipeline adds causes a finding proves)."""
        return self.thread.submit(self.engine.cause, cause_id).result()

    async def load(self) -> None:
        await self.thread.call(self.engine.load)

    async def rebuild(self) -> str:
        return await self.thread.call(self.engine.rebuild)

    async def entry(self, cause_id: str) -> dict:
        """The full KB entry of a cause (for the detail screen)."""
        return await self.thread.call(self.engine.cause, cause_id)


class Launcher:
    """Runs a person's launch command and answers for it (assistant.watch.run_and_diagnose).

    The answer comes from `engine` (the chat's Knowledge, so engine calls stay
    on the one engine thread) with `assistant run`'s defaults (watch.RunOptions);
    `probe=False` skips the probes after a failure.
    assistant.watch is imported on the first run, not when the chat opens.
    """

    def __init__(self, engine: Any, probe: bool = True):
        self.engine = engine
        self.probe = probe

    def run(self, command: list[str], callbacks: Any, cancel: threading.Event):
        """The RunOutcome of `command` (blocks: call it from a worker thread)."""
        watch = importlib.import_module("assistant.watch")
        options = watch.RunOptions(probe=self.probe)
        return watch.run_and_diagnose(command, options, self.engine, callbacks, cancel)


class ProbeRuns:
    """The question, doctor and lint workers in flight, each with its cancel event.

    Worker threads enter `track()`; quitting calls `cancel_all()` and waits
    in `wait_idle()` until every one has returned (the runner kills its
    processes when its event is set).
    """

    def __init__(self) -> None:
        self._cancels: set[threading.Event] = set()
        self._changed = threading.Condition()

    @contextmanager
    def track(self, cancel: threading.Event | None = None) -> Iterator[threading.Event]:
        cancel = cancel or threading.Event()
        with self._changed:
            self._cancels.add(cancel)
        try:
            yield cancel
        finally:
            with self._changed:
                self._cancels.discard(cancel)
                self._changed.notify_all()

    @property
    def count(self) -> int:
        with self._changed:
            return len(self._cancels)

    def cancel_all(self) -> None:
        with self._changed:
            for cancel in self._cancels:
                cancel.set()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no run is in flight (True) or `timeout` passes (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._cancels, timeout)
