"""Rank 0 working alone past a process-group timeout shortened below the default.

`dist.init_process_group("nccl", timeout=timedelta(minutes=5))`, then each
epoch `if rank == 0: evaluate(model, val_loader)` over the whole validation
set while every other rank waits in the `dist.barrier()` right after: the
waiting collective counts against the group's timeout, and an evaluation
longer than five minutes ends the job with a watchdog timeout (NCCL's
default is ten minutes; a shorter one is a choice the file made, often to
fail fast on real hangs). Reported at the waiting collective when the
timeout resolves below the default (a literal, an argparse default) and the
rank-0 branch just before it walks data (a loop, or a same-file function
with one).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.checks.collective_reach import first_collective
from assistant.lint.checks.unused import statement_lists
from assistant.lint.model import Script, keyword, short, source_text, walk
from assistant.lint.ranks import RANK_ZERO, rank_branch_sides
from assistant.lint.registry import check
from assistant.lint.torchapi import init_calls
from assistant.lint.values import resolved_int
from assistant.results import Finding

DEFAULT_NCCL_TIMEOUT_S = 600  # torch's default for NCCL process groups
TIMEDELTA_UNITS = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400}


@check("collective-timeout")
def check_rank_zero_work_past_a_short_timeout(script: Script) -> Iterator[Finding]:
    """The other ranks wait in a collective while rank 0 alone walks data, under a
    process-group timeout shorter than the default."""
    timeout = shortened_timeout(script)
    if timeout is None:
        return
    seconds, init = timeout
    for block in statement_lists(script.tree):
        for position, statement in enumerate(block[:-1]):
            if not isinstance(statement, ast.If):
                continue
            body_side, _ = rank_branch_sides(statement.test, script)
            if body_side != RANK_ZERO or statement.orelse:
                continue
            work = data_walk(script, statement.body)
            waiting = first_collective(script, block[position + 1 : position + 2])
            if work is None or waiting is None:
                continue
            yield script.finding(
                "collective-timeout",
                waiting,
                f"the other ranks wait in {short(script.name_of(waiting.func))}() while rank 0 "
                f"alone runs {source_text(work)[:60]} (line {work.lineno}), under a process-group "
                f"timeout of {duration(seconds)} (line {init.lineno}, shorter "
                "than NCCL's default 10 min): a pass that outlasts it ends the job with a "
                "watchdog timeout; spread that work over every rank's share, or give the "
                "group a timeout longer than it",
            )


def duration(seconds: int) -> str:
    """300 -> "5 min", 90 -> "90 s"."""
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


def shortened_timeout(script: Script) -> tuple[int, ast.Call] | None:
    """(seconds, the init call) for an init_process_group whose timeout resolves
    below the default."""
    for init in init_calls(script):
        value = keyword(init, "timeout")
        if not (isinstance(value, ast.Call) and short(script.name_of(value.func)) == "timedelta"):
            continue
        seconds = 0
        for given in value.keywords:
            amount = resolved_int(script, given.value)
            if given.arg not in TIMEDELTA_UNITS or amount is None:
                seconds = None
                break
            seconds += amount * TIMEDELTA_UNITS[given.arg]
        if seconds and seconds < DEFAULT_NCCL_TIMEOUT_S:
            return seconds, init
    return None


def data_walk(script: Script, body: list[ast.stmt]) -> ast.AST | None:
    """A loop in the block, or a call of a same-file function that loops (an
    evaluation over a loader): what rank 0 spends its time on."""
    for statement in body:
        for node in walk(statement):
            if isinstance(node, ast.For | ast.While):
                return node
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                function = script.functions.get(node.func.id)
                if function is not None and any(
                    isinstance(inner, ast.For | ast.While) for inner in walk(function)
                ):
                    return node
    return None
