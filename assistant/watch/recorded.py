"""Watched launches saved to and read from a file (tests/fixtures/gpu/runs.json).

A launch this machine cannot make (NCCL on a real GPU: two ranks on one
device, a NCCL hang, CUDA out of memory) is watched where it can be made
(tests/gpu/record_runs.py, on a lent GPU machine), saved with everything
the watcher found, and read back here so that the diagnosis (KB, lint,
verdicts) runs on the real reports:

    {"format": 1, "description": "...",
     "runs": [{"name": "...", "description": "...", "report": <report_to_json>,
               "output": "<the job's combined output, its end>",
               "files": {"<pid>.fr.json": {...}, "<pid>.stacks": "..."}}]}

`files` keeps the raw flight-recorder dumps and stack dumps the ranks left,
so that their readers are tested on what a real NCCL job writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from assistant.results import Finding, RootError
from assistant.watch.flight import LastCollective
from assistant.watch.hang import HangAnalysis
from assistant.watch.stacks import Frame
from assistant.watch.watcher import LaunchReport, RankReport

FORMAT = 1


def report_to_json(report: LaunchReport) -> dict:
    """Everything of a LaunchReport, JSON-ready (report_from_json reads it back)."""
    hang = report.hang
    return {
        "command": list(report.command),
        "exit_code": report.exit_code,
        "hung": report.hung,
        "log_dir": str(report.log_dir),
        "ranks": [_rank_to_json(rank) for rank in report.ranks],
        "root_error": report.root_error.to_json() if report.root_error else None,
        "root_text": report.root_text,
        "hang": None
        if hang is None
        else {
            "cause_id": hang.cause_id,
            "odd_ranks": list(hang.odd_ranks),
            "summary": hang.summary,
            "findings": [finding.to_json() for finding in hang.findings],
        },
        "seconds": round(report.seconds, 2),
        "quiet_seconds": report.quiet_seconds,
        "cancelled": report.cancelled,
        "gpu": list(report.gpu),
        "flight": list(report.flight),
    }


def report_from_json(data: dict) -> LaunchReport:
    """The LaunchReport that report_to_json wrote."""
    hang = data["hang"]
    return LaunchReport(
        command=list(data["command"]),
        exit_code=data["exit_code"],
        hung=data["hung"],
        log_dir=Path(data["log_dir"]),
        ranks=[_rank_from_json(rank) for rank in data["ranks"]],
        root_error=RootError(**data["root_error"]) if data["root_error"] else None,
        root_text=data["root_text"],
        hang=None
        if hang is None
        else HangAnalysis(
            hang["cause_id"],
            list(hang["odd_ranks"]),
            hang["summary"],
            [Finding(**finding) for finding in hang["findings"]],
        ),
        seconds=data["seconds"],
        quiet_seconds=data["quiet_seconds"],
        cancelled=data["cancelled"],
        gpu=list(data["gpu"]),
        flight=list(data["flight"]),
    )


def _rank_to_json(rank: RankReport) -> dict:
    return {
        **rank.to_json(),
        "pid": rank.pid,
        "error": rank.error,  # the hook's whole record, frames included
        "stack": [frame.to_json() for frame in rank.stack],
        "last_collective": asdict(rank.last_collective) if rank.last_collective else None,
    }


def _rank_from_json(data: dict) -> RankReport:
    frame = data["where"]
    last = data["last_collective"]
    return RankReport(
        rank=data["rank"],
        local_rank=data["local_rank"],
        host=data["host"],
        pid=data["pid"],
        exit_code=data["exit_code"],
        error=data["error"],
        where=Frame(**frame) if frame else None,
        waiting_in=data["waiting_in"],
        stack=[Frame(**f) for f in data["stack"]],
        last_collective=LastCollective(**last) if last else None,
    )


def save_launches(path: Path, runs: list[dict], description: str = "") -> None:
    """Write recorded launches (each: name, description, report, output, files)."""
    data = {"format": FORMAT, "description": description, "runs": runs}
    Path(path).write_text(
        json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8"
    )


def load_launches(path: Path) -> dict[str, dict]:
    """Recorded launches by name, each with its report rebuilt as a LaunchReport."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {run["name"]: {**run, "report": report_from_json(run["report"])} for run in data["runs"]}
