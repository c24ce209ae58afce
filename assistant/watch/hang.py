"""Which rank hangs, and why: from every rank's stack at the moment of the hang.

Each live rank stands somewhere in its own code (`where`: the innermost
frame of the user's files) and may be blocked in a torch.distributed call
(`waiting_in`). From those positions:

- some ranks wait in a collective while others are outside any: those
  others are the stragglers (collective-timeout);
- ranks wait in different collectives: if one waits inside a loop and the
  others in a collective after that loop, the others ran out of batches
  first (uneven-inputs); otherwise a collective only some ranks reach
  (collective-mismatch), and the rank(s) in the collective the rest went
  past are named;
- every rank waits in the same collective at the same line, while a rank
  has already left the job: it left early (uneven-inputs when it exited
  cleanly); when none left, the collective itself does not complete
  (collective-timeout);
- no rank is in a collective: the job is stuck in its own code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache

from assistant.results import Finding
from assistant.watch.stacks import Frame


@dataclass
class RankPosition:
    """Where one rank stood when the job hung."""

    rank: int
    alive: bool
    where: Frame | None = None
    waiting_in: str | None = None
    exited_cleanly: bool = False

    def place(self) -> str:
        spot = (
            f"{self.where.short()} in {self.where.function}" if self.where else "an unknown place"
        )
        if self.waiting_in:
            return f"waits in {self.waiting_in} at {spot}"
        return f"is at {spot}, outside any collective"


@dataclass
class HangAnalysis:
    """The diagnosis of a hang: the named ranks, one finding per named rank, a summary."""

    cause_id: str | None
    odd_ranks: list[int]
    summary: str
    findings: list[Finding] = field(default_factory=list)


def analyse(positions: list[RankPosition], quiet_seconds: float) -> HangAnalysis:
    """Name the rank(s) not where the others wait, and the cause that fits."""
    live = [p for p in positions if p.alive]
    waiting = [p for p in live if p.waiting_in]
    outside = [p for p in live if not p.waiting_in]
    gone = [p for p in positions if not p.alive]
    header = f"no rank made progress for {quiet_seconds:.0f} s"
    if waiting and outside:
        return _stragglers(outside, waiting, header)
    if len({_spot(p) for p in waiting}) > 1:
        return _different_collectives(waiting, header)
    if waiting and gone:
        return _left_early(gone, waiting, header)
    if waiting:
        return _stuck_collective(waiting, header)
    places = _places(live) or "no rank is alive"
    return HangAnalysis(
        None, [], f"{header}, and no rank is inside a torch.distributed call: {places}"
    )


def _spot(position: RankPosition) -> tuple:
    where = position.where
    return (position.waiting_in, where.file if where else None, where.line if where else None)


def _finding(cause_id: str, position: RankPosition, message: str) -> Finding:
    where = position.where
    return Finding(
        cause_id,
        where.line if where else 0,
        message,
        path=where.file if where else "",
        source="probe",
    )


def _places(positions: list[RankPosition]) -> str:
    return "; ".join(f"rank {p.rank} {p.place()}" for p in positions)


def _ranks(positions: list[RankPosition]) -> str:
    numbers = [str(p.rank) for p in positions]
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(numbers)


def _stragglers(outside, waiting, header) -> HangAnalysis:
    others = _places(waiting)
    findings = [
        _finding(
            "collective-timeout",
            p,
            f"rank {p.rank} {p.place()} while {others}: rank {p.rank} is the straggler",
        )
        for p in outside
    ]
    summary = (
        f"{header}: {_ranks(outside)} never reached the collective the others wait in ({others})"
    )
    return HangAnalysis("collective-timeout", [p.rank for p in outside], summary, findings)


def _different_collectives(waiting, header) -> HangAnalysis:
    groups: dict[tuple, list[RankPosition]] = {}
    for position in waiting:
        groups.setdefault(_spot(position), []).append(position)
    uneven = _ran_out_of_batches(groups)
    if uneven is not None:
        in_loop, past_loop = uneven
        return _uneven(in_loop, past_loop, header)
    # The ranks in the collective the others went past: the smallest group,
    # and on a tie the one earliest in the file.
    odd_spot = min(groups, key=lambda spot: (len(groups[spot]), spot[2] or 0))
    odd = groups[odd_spot]
    rest = [p for p in waiting if p not in odd]
    others = _places(rest)
    findings = [
        _finding(
            "collective-mismatch",
            p,
            f"rank {p.rank} {p.place()}, a collective {_ranks(rest)} never issued ({others})",
        )
        for p in odd
    ]
    summary = f"{header}: the ranks wait in different collectives; {_ranks(odd)} {odd[0].place()} while {others}"
    return HangAnalysis("collective-mismatch", [p.rank for p in odd], summary, findings)


def _ran_out_of_batches(groups) -> tuple[list, list] | None:
    """(ranks still in a loop's collective, ranks waiting after that loop), if so."""
    for spot, inside in groups.items():
        loop = enclosing_loop(spot[1], spot[2]) if spot[1] else None
        if loop is None:
            continue
        after = [
            p
            for other, members in groups.items()
            if other != spot and other[1] == spot[1] and (other[2] or 0) > loop[1]
            for p in members
        ]
        if after and len(after) + len(inside) == sum(len(m) for m in groups.values()):
            return inside, after
    return None


def _uneven(in_loop, past_loop, header) -> HangAnalysis:
    loop_ranks = _places(in_loop)
    findings = [
        _finding(
            "uneven-inputs",
            p,
            f"rank {p.rank} left the loop and {p.place()} while {loop_ranks} inside the loop: "
            f"rank {p.rank} ran out of batches first",
        )
        for p in past_loop
    ]
    summary = f"{header}: {_ranks(past_loop)} finished the loop early and {past_loop[0].place()} while {loop_ranks}"
    return HangAnalysis("uneven-inputs", [p.rank for p in past_loop], summary, findings)


def _left_early(gone, waiting, header) -> HangAnalysis:
    others = _places(waiting)
    clean = [p for p in gone if p.exited_cleanly]
    cause = "uneven-inputs" if clean else "collective-timeout"
    how = "finished and left" if clean else "died"
    message = f"{_ranks(gone)} {how} while {others}"
    findings = [_finding(cause, w, message) for w in waiting[:1]]
    return HangAnalysis(cause, [p.rank for p in gone], f"{header}: {message}", findings)


def _stuck_collective(waiting, header) -> HangAnalysis:
    spot = waiting[0].place()
    message = (
        f"every rank {spot}: the collective itself does not complete "
        "(transport, network interface or a peer on another node)"
    )
    findings = [_finding("collective-timeout", waiting[0], message)]
    return HangAnalysis("collective-timeout", [], f"{header}: {message}", findings)


@lru_cache(maxsize=64)
def enclosing_loop(path: str, line: int | None) -> tuple[int, int] | None:
    """(first, last) line of the innermost for/while loop around a line of a file."""
    if line is None:
        return None
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and (best is None or node.lineno >= best[0]):
                best = (node.lineno, end)
    return best
