"""Reading the stacks faulthandler wrote for a rank: where it stands, what it waits in.

A dump is faulthandler's text, one block per thread, innermost frame first:

    Thread 0x00007f3a1c5ff640 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 324 in wait
    Current thread 0x00007f3a2d1b7740 (most recent call first):
      File ".../torch/distributed/distributed_c10d.py", line 2950 in all_reduce
      File ".../torch/distributed/c10d_logger.py", line 81 in wrapper
      File "/home/me/train.py", line 14 in main

The main thread is the one whose id the hook recorded (the "current" thread
is only the one the signal happened to interrupt).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from assistant.watch.jobhook import COLLECTIVES

THREAD_LINE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
FRAME_LINE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*?)\s*$')
# Paths of code that is not the user's: the standard library, installed
# packages, frozen modules, this hook.
LIBRARY_PATH = re.compile(
    r"(/site-packages/|/dist-packages/|/lib/python\d+(\.\d+)?t?/|^<|/sitecustomize\.py$)"
)


@dataclass(frozen=True)
class Frame:
    """One stack frame: file, line, function."""

    file: str
    line: int
    function: str

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "function": self.function}

    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclass
class ThreadStack:
    """One thread's frames, innermost first."""

    ident: int
    frames: list[Frame]


def parse_dump(text: str) -> list[ThreadStack]:
    """Every thread of a faulthandler dump, in the order written."""
    threads: list[ThreadStack] = []
    for line in text.splitlines():
        header = THREAD_LINE.match(line)
        if header:
            threads.append(ThreadStack(int(header.group(2), 16), []))
            continue
        frame = FRAME_LINE.match(line)
        if frame and threads:
            threads[-1].frames.append(Frame(frame["file"], int(frame["line"]), frame["function"]))
    return threads


def main_thread(threads: list[ThreadStack], main_ident: int | None) -> ThreadStack | None:
    """The main thread's stack (by the id the hook recorded), else the last one dumped."""
    for thread in threads:
        if thread.ident == main_ident:
            return thread
    return threads[-1] if threads else None


def is_user_file(path: str) -> bool:
    """Whether a frame's file is the user's own code (not Python's, not a package's)."""
    return not LIBRARY_PATH.search(path.replace("\\", "/"))


def innermost_user_frame(frames: list[Frame]) -> Frame | None:
    """Where the user's own code stands: the innermost frame in one of its files."""
    return next((f for f in frames if is_user_file(f.file)), None)


def waiting_in(frames: list[Frame]) -> str | None:
    """The torch.distributed call the thread is blocked in (the one the user's code made).

    The outermost collective frame inside torch/distributed/ is the call the
    user made; inner ones are its helpers. "backward" when the thread is in
    autograd's backward (where DDP's gradient all_reduce runs) and in no
    collective.
    """
    called = None
    in_backward = False
    for frame in frames:
        path = frame.file.replace("\\", "/")
        if "/torch/distributed/" in path and frame.function in COLLECTIVES:
            called = frame.function
        elif "/torch/autograd/" in path and frame.function == "backward":
            in_backward = True
    if called is None and in_backward:
        return "backward"
    return called
