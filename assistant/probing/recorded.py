"""Probe runs saved to and read from a facts file (tests/fixtures/facts/*.json).

Recorded facts stand in for machines this project does not have (eight
GPUs, two ranks on one GPU, no driver): tests/gpu/record_facts.py writes
them on such a machine, the verdict and TUI tests read them back.

    {"format": 1, "scenario": "...", "description": "...",
     "runs": [{"name": "devices", "status": "ok", "seconds": 1.2,
               "detail": "...", "ranks": [<rank record>, ...]}]}

The rank records are the probes' own (probe_protocol.RankRecord reads them).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from assistant.probing.protocol import FORMAT
from assistant.results import ProbeRun


def save_runs(path: Path, runs: list[ProbeRun], scenario: str = "", description: str = "") -> None:
    """Write probe runs as a facts file."""
    data = {
        "format": FORMAT,
        "scenario": scenario,
        "description": description,
        "runs": [
            {
                "name": r.name,
                "status": r.status,
                "seconds": round(r.seconds, 3),
                "detail": r.detail,
                "ranks": r.ranks,
            }
            for r in runs
        ],
    }
    Path(path).write_text(
        json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8"
    )


def load_runs(path: Path) -> list[ProbeRun]:
    """Read a facts file written by save_runs."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return [
        ProbeRun(r["name"], r["status"], float(r["seconds"]), list(r["ranks"]), r.get("detail", ""))
        for r in data["runs"]
    ]


class RecordedRunner:
    """Answers run() with the probe runs of a facts file, as the real runner would.

    Stands in for ProbeRunner where the machine is not this one: a launch
    recorded on a GPU machine is diagnosed with the probe facts recorded
    there, and tests judge machines this project does not have. Progress is
    reported like the real runner's; every call's names are kept (`calls`),
    and `started` is set on the first. A probe the file does not hold is left
    out of the answer, as if it had not run: nothing is made up for it.
    """

    def __init__(self, path: Path):
        self.runs = {run.name: run for run in load_runs(path)}
        self.calls: list[list[str]] = []
        self.started = threading.Event()

    def run(self, names, on_progress=None, cancel=None) -> list[ProbeRun]:
        from assistant.probing.runner import ProgressEvent

        self.calls.append(list(names))
        self.started.set()
        names = [name for name in names if name in self.runs]
        for name in names:
            if on_progress:
                on_progress(ProgressEvent(name, "started", 0.0))
                on_progress(ProgressEvent(name, "finished", 0.1, self.runs[name].status))
        return [self.runs[name] for name in names]
