"""Turning what a launch left behind into ProbeRuns.

A launch can end well (every record final), crash, overrun the launch
deadline, have one probe overrun its budget, or be cancelled. Ranks that
never wrote a final record get one here, saying why; set_device_order's
variant launches are filed under its preflight records and summed up with
the protocol's own reading of them (variant_outcomes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from assistant.probing.protocol import new_record, variant_outcomes
from assistant.probing.records import status_of
from assistant.results import ProbeRun


@dataclass
class LaunchEnd:
    """Why a launch stopped."""

    reason: str  # "done" | "exit" | "timeout" | "probe_timeout" | "cancelled"
    code: int | None = None
    hung: str | None = None
    seconds: float = 0.0


@dataclass
class LaunchResult:
    """One torchrun start and what it left behind."""

    probes: list[str]
    nproc: int
    end: LaunchEnd
    records: dict[tuple[str, int], dict]
    log_tail: list[str]
    budgets: dict[str, float]
    started_at: dict[str, float] = field(default_factory=dict)
    timeout: float = 0.0

    def lost_port_race(self) -> bool:
        """torchrun died because the free port was taken between pick and bind."""
        return (
            self.end.reason == "exit"
            and not self.records
            and any(
                "EADDRINUSE" in line or "address already in use" in line.lower()
                for line in self.log_tail
            )
        )


def batch_runs(launch: LaunchResult) -> tuple[dict[str, ProbeRun], list[str]]:
    """ProbeRuns of a batch launch, and the probes to run again.

    After a probe hung, the probes that never started get another launch.
    """
    runs: dict[str, ProbeRun] = {}
    rerun: list[str] = []
    for name in launch.probes:
        if launch.end.reason == "probe_timeout" and name not in launch.started_at:
            rerun.append(name)
            continue
        ranks, status, detail = finish_records(launch, name)
        runs[name] = ProbeRun(name, status, _seconds(launch, name, ranks), ranks, detail)
    return runs, rerun


def finish_records(launch: LaunchResult, name: str) -> tuple[list[dict], str, str]:
    """Every rank's record of a probe, completing those the launch cut short."""
    records = [launch.records.get((name, rank)) for rank in range(launch.nproc)]
    if all(r and r["status"] != "running" for r in records):
        status, detail = status_of(records)
        return records, status, detail
    status, detail = _cut_short(launch, name, records)
    completed = []
    for rank, record in enumerate(records):
        if record is None:
            record = new_record(name, status, rank=rank, reason=detail)
        elif record["status"] == "running":
            record = {**record, "status": status, "reason": detail}
        completed.append(record)
    return completed, status, detail


def _cut_short(launch: LaunchResult, name: str, records: list[dict | None]) -> tuple[str, str]:
    """Status and detail of a probe whose launch ended before all ranks finished."""
    end = launch.end
    if end.reason == "cancelled":
        return "interrupted", "stopped before it finished"
    if end.reason == "probe_timeout":
        if name == end.hung:
            step = next(
                (r["facts"].get("step") for r in records if r and r["facts"].get("step")), None
            )
            where = f" (stuck in {step})" if step else ""
            return "timeout", f"no answer within {launch.budgets[name]:g} s{where}"
        return "timeout", f"stopped: other ranks were stuck in {end.hung}"
    if end.reason == "timeout":
        if name in launch.started_at:
            return "timeout", f"no answer before the launch deadline ({launch.timeout:g} s)"
        return "timeout", f"not reached before the launch deadline ({launch.timeout:g} s)"
    return "error", exit_detail(end.code, launch.log_tail)


def _seconds(launch: LaunchResult, name: str, ranks: list[dict]) -> float:
    """A probe's own time: its slowest rank, or its whole budget if it hung."""
    hung = any(r["status"] == "timeout" for r in ranks)
    if hung and launch.end.reason in ("probe_timeout", "timeout") and name in launch.started_at:
        return launch.budgets[name]
    return max((r.get("seconds") or 0.0) for r in ranks) if ranks else 0.0


def exit_detail(code: int | None, log_tail: list[str]) -> str:
    """The error a crashed launch printed, e.g. "No module named 'torch'"."""
    for line in reversed(log_tail):
        if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", line):
            return line
    if log_tail:
        return log_tail[-1]
    return f"torchrun exited with code {code}"


# Keys of a variant launch's rank record kept under the preflight's facts.
VARIANT_KEYS = ("status", "reason", "problems", "seconds", "pid", "facts")


def merge_variants(
    name: str,
    variants: tuple[str, ...],
    preflight: ProbeRun,
    launches: dict[str, LaunchResult],
    cancelled: bool,
) -> ProbeRun:
    """File each variant's per-rank record under facts["variants"] of the preflight records."""
    ranks = [dict(record, facts=dict(record["facts"], variants={})) for record in preflight.ranks]
    seconds = preflight.seconds
    for variant, launch in launches.items():
        records, _, _ = finish_records(launch, name)
        seconds += launch.end.seconds
        for rank, record in zip(ranks, records):
            rank["facts"]["variants"][variant] = {key: record.get(key) for key in VARIANT_KEYS}
    outcomes = variant_outcomes(ranks)
    kinds = {outcome.kind for outcome in outcomes.values()}
    if (cancelled and len(outcomes) < len(variants)) or "interrupted" in kinds:
        status = "interrupted"
    elif kinds == {"ok"}:
        status = "ok"
    elif kinds == {"hang"}:
        status = "timeout"
    elif kinds == {"error"}:
        status = "error"
    else:
        status = "failed"
    detail = "; ".join(f"{variant} {outcome.describe()}" for variant, outcome in outcomes.items())
    return ProbeRun(name, status, seconds, ranks, detail)
