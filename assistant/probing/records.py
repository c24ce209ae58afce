"""Reading what a launch leaves behind: each rank's records, and the launch log.

The ranks write `<probe>.rank<R>.json` into the facts folder (the format is
in probes/probe_protocol.py), rewriting it at checkpoints, always by
write-then-rename. RecordWatch rereads only files that changed and turns
them into "started"/"finished" events per probe.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from assistant.probing.protocol import is_record_filename

# Statuses that explain a probe's outcome, worst first: one rank's error
# outranks another's timeout, and so on.
WORST_FIRST = ("error", "timeout", "interrupted", "failed")


class RecordWatch:
    """The records of one launch as they appear, and which probes are done."""

    def __init__(self, facts_dir: Path, probes: list[str], nproc: int):
        self.facts_dir = facts_dir
        self.probes = probes
        self.nproc = nproc
        self.records: dict[tuple[str, int], dict] = {}
        self.first_seen: dict[str, float] = {}
        self.done: set[str] = set()
        self._stamps: dict[str, tuple[int, int]] = {}

    def update(self, now: float) -> list[tuple[str, str, str | None]]:
        """Reread changed records; return (probe, "started"|"finished", status) events."""
        self._read()
        events = []
        for name in self.probes:
            mine = self.of(name)
            if name not in self.first_seen and any(mine):
                self.first_seen[name] = now
                events.append((name, "started", None))
            if name not in self.done and all(r and r["status"] != "running" for r in mine):
                self.done.add(name)
                events.append((name, "finished", status_of(mine)[0]))
        return events

    def reread(self) -> None:
        """Pick up records written since the last update, without events (after a kill)."""
        self._read()

    def of(self, name: str) -> list[dict | None]:
        """A probe's record per rank, None where a rank has written none yet."""
        return [self.records.get((name, rank)) for rank in range(self.nproc)]

    def all_done(self) -> bool:
        return len(self.done) == len(self.probes)

    def overdue(self, budgets: dict[str, float], now: float) -> str | None:
        """The first started, unfinished probe past its budget."""
        for name in self.probes:
            since = self.first_seen.get(name)
            if since is not None and name not in self.done and now - since > budgets[name]:
                return name
        return None

    def _read(self) -> None:
        try:
            entries = list(os.scandir(self.facts_dir))
        except OSError:
            return
        for entry in entries:
            if not is_record_filename(entry.name):
                continue  # a record being written
            stat = entry.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if self._stamps.get(entry.name) == stamp:
                continue
            try:
                record = json.loads(Path(entry.path).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            self._stamps[entry.name] = stamp
            self.records[(record.get("probe"), record.get("rank"))] = record


def status_of(records: list[dict]) -> tuple[str, str]:
    """A probe's status and one-line detail from its final per-rank records."""
    statuses = [r["status"] for r in records]
    for status in WORST_FIRST:
        if status in statuses:
            culprit = next(r for r in records if r["status"] == status)
            return status, detail_of(culprit)
    if all(s == "not_applicable" for s in statuses):
        return "not_applicable", records[0].get("reason") or ""
    return "ok", detail_of(records[0])


def detail_of(record: dict) -> str:
    """One line for people: the problems, else the reason, else the summary."""
    text = (
        "; ".join(record.get("problems") or [])
        or record.get("reason")
        or record.get("summary")
        or ""
    )
    rank = record.get("rank")
    if record.get("status") in ("failed", "error", "timeout") and rank is not None:
        text = f"rank {rank}: {text}"
    return " ".join(text.split())


def log_tail(path: Path, lines: int = 40) -> list[str]:
    """The last lines of a launch log, without torch's [rankN]: prefixes."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    cleaned = [re.sub(r"^\[(?:rank)?\d+\]:\s*", "", line).strip() for line in text.splitlines()]
    return [line for line in cleaned if line][-lines:]
