"""torch's flight recorder at a hang: the last collective each rank issued, compared.

The flight recorder numbers every collective a rank issues on a process
group (collective_seq_id). At a hang, ranks at the same number with
different operations issued mismatched collectives; a rank at a lower
number is behind the others. This is what PyTorch's own flight-recorder
analyser reports, taken here on demand from the live ranks (see jobhook),
for NCCL and, on recent torch, gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

# torch reads this (and the older TORCH_NCCL_TRACE_BUFFER_SIZE) when a group
# is created; `assistant run` sets it for the job unless the user did.
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
BUFFER_ENTRIES = "2000"


@dataclass(frozen=True)
class LastCollective:
    """The last collective a rank issued on the default group, per its flight recorder."""

    seq: int
    op: str
    state: str
    retired: bool = False
    # When the default group has none: the rank's last entry on another group
    # ("gloo:barrier on group 1 (scheduled)"), so a line never says it issued nothing.
    elsewhere: str = ""

    def to_json(self) -> dict:
        return {"seq": self.seq, "op": self.op, "state": self.state}

    def pending(self) -> str | None:
        """The NCCL collective still in flight ("all_reduce"), else None.

        NCCL collectives are asynchronous: the Python call returns at once
        and the rank blocks later (in .item(), a synchronize, the next
        step), so its stack shows no collective; its recorder does. gloo's
        entries are not tracked to completion, so only NCCL's count here.
        """
        if not self.op.startswith("nccl:") or self.state == "completed" or self.retired:
            return None
        return self.op.split(":", 1)[1]


def with_buffer(env: dict[str, str]) -> dict[str, str]:
    """The job's environment with the flight recorder on (the user's own setting wins)."""
    if any(env.get(name) for name in BUFFER_VARS):
        return env
    return {**env, BUFFER_VARS[0]: BUFFER_ENTRIES}


NONE_YET = LastCollective(0, "none", "none")  # a recorder that saw no collective yet


def last_collective(record: dict | None) -> LastCollective | None:
    """The last non-p2p entry of a rank's dump on the default group (id "0").

    None when there is no recorder to read; NONE_YET when it holds no
    collective of the default group (with `elsewhere` naming its last entry
    on another group, if any). A NCCL collective enters the recorder only
    once its communicator is up: a rank blocked in the communicator's setup
    (its first collective, a peer that never joins) shows none, while its
    stack waits in the collective (seen on an H200, tests/fixtures/gpu/runs.json).
    """
    if not record or not record.get("available"):
        return None
    elsewhere = ""
    for entry in reversed(record.get("entries") or []):
        if entry.get("is_p2p"):
            continue
        group = str((entry.get("process_group") or ["0"])[0])
        op, state = str(entry.get("profiling_name") or "?"), str(entry.get("state") or "?")
        if group != "0":
            elsewhere = elsewhere or f"{op} on group {group} ({state})"
            continue
        return LastCollective(
            int(entry.get("collective_seq_id") or 0), op, state, bool(entry.get("retired"))
        )
    return LastCollective(0, "none", "none", elsewhere=elsewhere) if elsewhere else NONE_YET


def compare(last: dict[int, LastCollective]) -> list[str]:
    """One line per rank, then what the numbers say (mismatch, or who is behind)."""
    if not last:
        return []
    lines = [
        f"flight recorder: rank {rank} issued collective #{c.seq} {c.op} ({c.state})"
        if c.seq
        else f"flight recorder: rank {rank} has recorded no collective on the default group"
        + (f"; its last entry: {c.elsewhere}" if c.elsewhere else "")
        for rank, c in sorted(last.items())
    ]
    top = max(c.seq for c in last.values())
    behind = sorted(rank for rank, c in last.items() if c.seq < top)
    ops_at_top = {c.op for c in last.values() if c.seq == top}
    if len(ops_at_top) > 1:
        lines.append(
            f"flight recorder: collective #{top} is {' vs '.join(sorted(ops_at_top))} "
            "on different ranks: a mismatch"
        )
    if behind:
        names = ", ".join(str(rank) for rank in behind)
        lines.append(f"flight recorder: rank(s) {names} never issued collective #{top}")
    return lines
