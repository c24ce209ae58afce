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
        """Every output file: each process's in start order, then the launch's.

        Within one poll the launch's files are read last because a launcher
        speaks last: torchrun prints its failure summary only once the
        workers have exited, so whatever they wrote in the same poll came
        before it, and the summary ends the merged output.
        """
        found = []
        procs = Path(procs_dir(str(self.watch_dir)))
        for path in sorted(procs.glob("*.out"), key=_pid):
            found.append((path, "stdout"))
            found.append((path.with_suffix(".err"), "stderr"))
        found.append((self.watch_dir / "launch.out", "stdout"))
        found.append((self.watch_dir / "launch.err", "stderr"))
        return found

    def poll(self) -> int:
        """Pass on everything written since the last poll; the number of bytes."""
        total = 0
        for path, stream in self.files():
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


def _pid(path: Path) -> int:
    return int(path.stem) if path.stem.isdigit() else 0
