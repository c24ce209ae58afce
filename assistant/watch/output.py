"""Streaming the job's output as it is written, from every file it goes to.

Every Python process of the job writes its stdout/stderr to its own files
(jobhook redirects them); anything else (a shell wrapper, srun itself, a
task on another node) writes to the launch's own stdout/stderr files. The
tail reads what each file gained since the last poll and hands it on
unchanged, and keeps a merged copy (output.log) for the record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

from assistant.watch.jobhook import procs_dir

OnOutput = Callable[[str, bytes], None]  # ("stdout" | "stderr", the bytes as written)
TAIL_LINES = 60  # lines of output kept for the answer when no rank left an exception
CHUNK = 1 << 20


class OutputTail:
    """Follows the launch's files and every process's .out/.err under a watch folder."""

    def __init__(self, watch_dir: Path, on_output: OnOutput | None, merged: Path):
        self.watch_dir = watch_dir
        self.on_output = on_output
        self.offsets: dict[Path, int] = {}
        self.merged = open(merged, "ab")  # noqa: SIM115 - open for the whole watch; close()
        self.last_lines: deque[bytes] = deque(maxlen=TAIL_LINES)
        self.partial = b""

    def files(self) -> list[tuple[Path, str]]:
        """Every output file: each process's, the latest started first, then the launch's."""
        found = []
        procs = Path(procs_dir(str(self.watch_dir)))
        for path in sorted(procs.glob("*.out"), key=_pid, reverse=True):
            found.append((path, "stdout"))
            found.append((path.with_suffix(".err"), "stderr"))
        found.append((self.watch_dir / "launch.out", "stdout"))
        found.append((self.watch_dir / "launch.err", "stderr"))
        return found

    def poll(self) -> int:
        """Pass on everything written since the last poll; the number of bytes."""
        total = 0
        for path, stream in in_write_order(self.files()):
            total += self._read(path, stream)
        return total

    def _read(self, path: Path, stream: str) -> int:
        offset = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as source:
                source.seek(offset)
                data = source.read(CHUNK)
        except OSError:
            return 0
        if not data:
            return 0
        self.offsets[path] = offset + len(data)
        self.merged.write(data)
        self._keep_lines(data)
        if self.on_output is not None:
            self.on_output(stream, data)
        return len(data)

    def _keep_lines(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        self.last_lines.extend(lines)

    def tail_text(self) -> str:
        """The last lines of the whole output, for an answer with no recorded exception."""
        lines = list(self.last_lines) + ([self.partial] if self.partial else [])
        return b"\n".join(lines).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.merged.close()


def in_write_order(files: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """The files that exist, the one written last at the end.

    A launcher speaks last: torchrun's agent (itself a watched process with
    a file of its own), srun or a wrapper prints its failure summary only
    once its workers have exited, so when their last words and its summary
    arrive in one poll the summary must end the merged output. Where the
    clock cannot tell two files apart, the given order holds (stable sort):
    later-started processes first, the launch's own files last.
    """
    stamped = []
    for path, stream in files:
        try:
            stamped.append((path.stat().st_mtime_ns, path, stream))
        except OSError:
            continue  # not created yet
    stamped.sort(key=lambda entry: entry[0])
    return [(path, stream) for _, path, stream in stamped]


def _pid(path: Path) -> int:
    return int(path.stem) if path.stem.isdigit() else 0
